"""AOTAutograd's cache keeps ember's compiled graphs (frontend/aot_cache.py): a second compile of the
same model skips AOTAutograd's tracing and ember's scheduling, and trains as eager does; what ember
could not keep (symbolic sizes), or compiled under other settings, is compiled anew; and what ember
stored there is loaded only if its signature matches ember's key."""

from __future__ import annotations

import struct

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

import ember
from tests.helpers import assert_no_fallback, forward_backward, fresh_inputs, params_of, reports
from tests.schedule.test_fusion_ranking import ConvBlocks


def _hits() -> int:
    return counters["aot_autograd"]["autograd_cache_hit"]


def _train_step(model, x, **options):
    torch._dynamo.reset()
    with reports() as report, ember.config.override(strict=True, backend="cpp", **options):
        compiled = torch.compile(model, backend="ember")
        out, grads = forward_backward(compiled, params_of(model), fresh_inputs([x]), grad_seed=1, train=True)
    assert_no_fallback(report, "conv blocks")
    return report, out, grads


def test_a_second_compile_loads_both_graphs_and_trains_as_eager(tmp_path):
    model = ConvBlocks().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    with ember.config.override(cache_dir=str(tmp_path)):
        first, _, _ = _train_step(model, x)
        before = _hits()
        second, out, grads = _train_step(model, x)
    assert _hits() == before + 1, "AOTAutograd's cache did not serve the second compile"
    assert [g.kind for g in second.graphs] == ["forward", "backward"]
    assert all(list(g.stage_seconds) == ["backend", "cached schedule", "build", "host"] for g in second.graphs)
    assert [[k.source for k in g.kernels] for g in second.graphs] == [
        [k.source for k in g.kernels] for g in first.graphs
    ]
    assert [g.host_source for g in second.graphs] == [g.host_source for g in first.graphs]
    ref_out, ref_grads = forward_backward(model, params_of(model), fresh_inputs([x]), grad_seed=1, train=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4)


def test_a_flex_attention_program_is_loaded_and_runs_as_eager(tmp_path):
    """Dynamo's graph holds the flex_attention op and its score and mask functions as subgraphs:
    AOTAutograd's cache keeps it, keyed by them."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=32)

    def fn(q):
        return flex_attention(q, k, v, block_mask=block_mask, score_mod=lambda s, b, h, qi, ki: s + (ki - qi) * 0.1)

    with ember.config.override(cache_dir=str(tmp_path)):
        assert _inference_hits(fn, q) == 0
        assert _inference_hits(fn, q) == 1


def test_causal_sdpa_rewritten_to_flex_is_loaded_and_trains_as_eager(tmp_path):
    """In training, causal SDPA becomes calls of frontend/masked_attention.py's functions in Dynamo's
    graph (Triton's code generator, here through its interpreter); marked for AOTAutograd's check, the
    graph is kept, and a second compile loads both graphs."""
    import torch.nn.functional as F

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True) * 2

    torch.manual_seed(0)
    inputs = [torch.randn(1, 2, 40, 16) for _ in range(3)]
    ref_out, ref_grads = forward_backward(fn, [], fresh_inputs(inputs), grad_seed=1, train=True)
    with ember.config.override(cache_dir=str(tmp_path), strict=True, backend="triton"):
        for hits in (0, 1):
            torch._dynamo.reset()
            before = _hits()
            with reports() as report:
                out, grads = forward_backward(torch.compile(fn, backend="ember"), [], fresh_inputs(inputs), 1, True)
            assert _hits() == before + hits
            assert_no_fallback(report, "causal sdpa as flex")
            assert "flex_attention_backward_kernel" in report.graphs[-1].host_source
            torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
            for g, r in zip(grads, ref_grads, strict=True):
                torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def _stored_then_loaded(tmp_path) -> None:
    """Two compiles of one model: the first stores its graphs in AOTAutograd's cache, the second loads them."""
    model = ConvBlocks().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    with ember.config.override(cache_dir=str(tmp_path)):
        _train_step(model, x)
        before = _hits()
        _train_step(model, x)
    assert _hits() == before + 1, "AOTAutograd's cache did not serve the second compile"


def test_keying_ember_s_graphs_registers_none_of_inductor_s_backends(tmp_path, monkeypatch):
    """AOTAutograd's key (Inductor's FxGraphHashDetails) would first register every code generator of
    Inductor, importing its schedulers and lowerings (over a second of a warm start): while ember's graphs
    are keyed, it does not, in the compile that stores them and in the one that loads them."""
    from torch._inductor import codecache

    calls = []
    monkeypatch.setattr(codecache, "init_backend_registration", lambda: calls.append(1))
    _stored_then_loaded(tmp_path)
    assert not calls, f"Inductor's backends were registered {len(calls)} times"
    codecache.init_backend_registration()  # Inductor's own entry point is back once ember's compile ends
    assert calls == [1]
    # Outside AOTAutograd's key for an ember compile, Inductor's keys read the registries as they are.
    from torch._inductor.codegen import common

    assert dict(codecache.custom_backend_passes) == common.custom_backend_passes


def test_keying_ember_s_graphs_hashes_no_installed_sources(tmp_path, monkeypatch):
    """Inductor's key hashes torch's and Triton's installed files (`torch_key`, `CacheBase.get_system`), some
    0.6 s of every process's first step: ember's graphs are keyed by the versions instead, in the compile that
    stores them and in the one that loads them; Inductor's own keys still call the originals."""
    from torch._inductor import codecache

    calls = []

    def counted(name, answer):
        def fn(*args, **kwargs):
            calls.append(name)
            return answer

        return fn

    monkeypatch.setattr(codecache, "torch_key", counted("torch_key", b"t"))
    monkeypatch.setattr(codecache.CacheBase, "get_system", staticmethod(counted("get_system", {"hash": "s"})))
    _stored_then_loaded(tmp_path)
    assert not calls, f"installed sources were hashed: {calls}"
    assert codecache.torch_key() == b"t" and codecache.CacheBase.get_system() == {"hash": "s"}
    assert calls == ["torch_key", "get_system"]


def test_other_settings_or_the_setting_off_compile_anew(tmp_path):
    model = ConvBlocks().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    with ember.config.override(cache_dir=str(tmp_path)):
        _train_step(model, x)
        before = _hits()
        unfused, _, _ = _train_step(model, x, fuse=False)  # ember's part of the key differs
        off, _, _ = _train_step(model, x, aot_cache=False)
    assert _hits() == before
    assert all("schedule" in g.stage_seconds for g in unfused.graphs)
    assert all("cached schedule" in g.stage_seconds for g in off.graphs)  # ember's own schedule cache


def test_symbolic_sizes_are_not_kept(tmp_path):
    def fn(x):
        return torch.relu(x) * 2

    with ember.config.override(cache_dir=str(tmp_path), strict=True, backend="cpp"):
        for _ in range(2):
            torch._dynamo.reset()
            before = _hits()
            x = torch.randn(6, 5)
            with reports() as report:
                out = torch.compile(fn, backend="ember", dynamic=True)(x)
            torch.testing.assert_close(out, fn(x))
            assert _hits() == before
            assert all("schedule" in g.stage_seconds for g in report.graphs)


def _inference_hits(fn, x, **options) -> int:
    torch._dynamo.reset()
    before = _hits()
    with torch.no_grad(), ember.config.override(strict=True, backend="cpp", **options):
        torch.testing.assert_close(torch.compile(fn, backend="ember")(x), fn(x), rtol=2e-2, atol=2e-2)
    return _hits() - before


def test_autocast_dtype_and_a_cleared_cache_are_misses(tmp_path):
    def fn(x, w):
        return torch.relu(x @ w) * 2

    x, w = torch.randn(8, 16), torch.randn(16, 16)
    with ember.config.override(cache_dir=str(tmp_path)):
        assert _inference_hits(lambda a: fn(a, w), x) == 0
        assert _inference_hits(lambda a: fn(a, w), x) == 1
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert _inference_hits(lambda a: fn(a, w), x) == 0
            assert _inference_hits(lambda a: fn(a, w), x) == 1
        with torch.autocast("cpu", dtype=torch.float16):
            assert _inference_hits(lambda a: fn(a, w), x) == 0
        for secret in ("aot-key", "aot-id"):  # what `ember cache clear` does to them
            (tmp_path / secret).unlink()
        assert _inference_hits(lambda a: fn(a, w), x) == 0


def test_sdpa_kernel_choice_is_part_of_the_key(tmp_path):
    """The kernel SDPA resolves to is picked while AOTAutograd traces, from the enabled kernels and
    their priority: a graph traced under other flags is not loaded."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def fn(q):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True) * 2

    q = torch.randn(2, 2, 8, 4)
    with ember.config.override(cache_dir=str(tmp_path)):
        assert _inference_hits(fn, q) == 0
        assert _inference_hits(fn, q) == 1
        with sdpa_kernel([SDPBackend.MATH]):
            assert _inference_hits(fn, q) == 0
            assert _inference_hits(fn, q) == 1


def test_a_hit_reads_the_current_values_of_module_tensors(tmp_path):
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.randn(16)  # a plain attribute: Dynamo passes it in as an input

        def forward(self, x):
            return x * self.scale

    m, x = Scaled(), torch.randn(4, 16)
    with ember.config.override(cache_dir=str(tmp_path)):
        assert _inference_hits(m, x) == 0
        m.scale = torch.randn(16)  # same shape, new values: the hit must compute with these
        assert _inference_hits(m, x) == 1  # _inference_hits compares with eager


def test_a_load_that_fails_warns_and_compiles_anew(tmp_path):
    model = ConvBlocks().to(memory_format=torch.channels_last)
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    with ember.config.override(cache_dir=str(tmp_path)):
        _train_step(model, x)
        # Another machine's CPU, as a cache folder shared between machines sees: the stored
        # schedules were made for another target.
        another_cpu = ember.config.override(fault_inject="cpu_arch=another CPU")
        with another_cpu, pytest.warns(UserWarning, match="did not load, compiling it anew"):
            report, out, _ = _train_step(model, x)
    assert [g.kind for g in report.graphs] == ["forward", "backward"]  # no report of the failed load
    assert all("schedule" in g.stage_seconds for g in report.graphs)
    ref_out, _ = forward_backward(model, params_of(model), fresh_inputs([x]), grad_seed=1, train=True)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-4)


def test_a_key_it_cannot_use_only_costs_the_hits(tmp_path):
    (tmp_path / "aot-key").mkdir()  # neither readable nor replaceable as a file

    def fn(x):
        return torch.sigmoid(x) * 3

    x = torch.randn(8, 8)
    with ember.config.override(cache_dir=str(tmp_path)):
        with pytest.warns(UserWarning, match="aot-key is not used"):
            assert _inference_hits(fn, x) == 0  # compiled (strict: no fallback), and matches eager
        assert _inference_hits(fn, x) == 0  # nothing signed, nothing saved: never a hit
    assert not list(tmp_path.glob(".tmp-*")), "a key left behind"


def _flip_constant(entries: list, old: float, new: float) -> None:
    """Replace the pickled float `old` with `new` in AOTAutograd's entry (ember's schedule holds it)."""
    (entry,) = entries
    data = entry.read_bytes()
    before, after = b"G" + struct.pack(">d", old), b"G" + struct.pack(">d", new)
    assert before in data, "the constant is not in the entry"
    entry.write_bytes(data.replace(before, after))


def test_a_changed_constant_is_not_loaded(tmp_path, monkeypatch):
    """A bit changed in ember's part of AOTAutograd's entry (in torch's folder, which another user
    may have made): a miss with a warning, and eager's result, not the changed program's."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))

    def fn(x):
        return x * 2.0 + 1

    x = torch.randn(8, 8)
    with ember.config.override(cache_dir=str(tmp_path / "ember")):
        assert _inference_hits(fn, x) == 0
        assert _inference_hits(fn, x) == 1
        _flip_constant([p for p in (tmp_path / "torch" / "aotautograd").rglob("*") if p.is_file()], 2.0, 3.0)
        with pytest.warns(UserWarning, match="signature does not match"):
            assert _inference_hits(fn, x) == 0  # compared with eager inside


def test_an_entry_not_signed_with_ember_s_key_is_not_loaded(tmp_path, monkeypatch):
    """An entry planted by someone without the key (played by signing with a wrong one)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "torch"))

    def fn(x):
        return torch.relu(x) - 1

    x = torch.randn(8, 8)
    with ember.config.override(cache_dir=str(tmp_path / "ember")):
        with ember.config.override(fault_inject="aot_sign"):  # saved, signed with a key not ember's
            assert _inference_hits(fn, x) == 0
        with pytest.warns(UserWarning, match="signature does not match"):
            assert _inference_hits(fn, x) == 0


def _signed_code(**changes):
    from ember.frontend.aot_cache import EmberGraphCode
    from ember.runtime.schedule_cache import KeptSchedule

    kept = {"pickled": b"schedule", "device": "cpu", "target": ("cpp", 0, 512)}
    code = {"kind": "forward", "num_nodes": 3, "options": {"fuse": True}}
    for name, value in changes.items():
        (kept if name in kept else code)[name] = value
    return EmberGraphCode(schedule=KeptSchedule(**kept), **code)


@pytest.mark.parametrize(
    "change",
    [
        {"pickled": b"schedulf"},
        {"device": "cuda:0"},
        {"target": ("cpp", 0, 513)},
        {"kind": "backward"},
        {"num_nodes": 4},
        {"options": {"fuse": False}},
        {"capture": ((0,), "facts")},
    ],
    ids=lambda change: next(iter(change)),
)
def test_the_signature_covers_everything_a_hit_builds_from(change):
    from ember.frontend import aot_cache

    key = b"k" * 32
    assert aot_cache._signature(key, _signed_code()) == aot_cache._signature(key, _signed_code())
    assert aot_cache._signature(key, _signed_code(**change)) != aot_cache._signature(key, _signed_code())
    assert aot_cache._signature(b"j" * 32, _signed_code()) != aot_cache._signature(key, _signed_code())


def test_the_compile_in_progress_is_this_thread_s_and_nests(tmp_path):
    """What in_force makes current is seen by this thread only, and an inner compile's ends with it."""
    import threading

    from ember.frontend import aot_cache

    seen = []
    with ember.config.override(cache_dir=str(tmp_path)):
        with aot_cache.in_force({"fuse": True}):
            outer = aot_cache._current.get()
            thread = threading.Thread(target=lambda: seen.append(aot_cache._current.get()))
            thread.start()
            thread.join()
            with aot_cache.in_force({"fuse": False}):
                inner = aot_cache._current.get()
            after_inner = aot_cache._current.get()
        after = aot_cache._current.get()
    assert outer.options == {"fuse": True} and len(outer.key) == 32
    assert inner.options == {"fuse": False} and inner.key == outer.key
    assert seen == [None] and after_inner is outer and after is None


@pytest.mark.parametrize("how", ["world_writable", "another_user"])
def test_torch_cache_folder_others_can_write_is_not_used(tmp_path, monkeypatch, how):
    """torch unpickles its part of an entry before ember checks its signature: where another user
    could write torch's cache folder (its default, /tmp/torchinductor_<user>, is a name anyone can
    create first), AOTAutograd's cache is bypassed, with one warning, and the graph still compiles."""
    import os

    torch_cache = tmp_path / "torchinductor"
    torch_cache.mkdir()
    if how == "world_writable":
        torch_cache.chmod(0o777)
    else:
        os.chown(torch_cache, 12345, 12345)  # plays another user: these tests run as root
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(torch_cache))  # a new folder: checked afresh

    def fn(x):
        return torch.sigmoid(x) * 3

    x = torch.randn(8, 8)
    with ember.config.override(cache_dir=str(tmp_path / "ember")):
        with pytest.warns(UserWarning, match="not using AOTAutograd's cache"):
            assert _inference_hits(fn, x) == 0  # compiled (strict: no fallback), and matches eager
        assert _inference_hits(fn, x) == 0  # nothing saved there: never a hit
    assert not (torch_cache / "aotautograd").exists(), "ember created a folder in the unsafe cache"
