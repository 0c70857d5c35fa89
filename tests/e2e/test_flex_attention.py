"""FlexAttention compiled into ember's own flash-attention kernel, against eager flex_attention (fp32):
score_mod and mask_mod functions inlined (reading captured tensors), BlockMask sparsity, GQA and the
log-sum-exp, on the C++ kernel and, at tiny sizes, the Triton kernel in Triton's interpreter."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import ember
from tests.helpers import assert_close, assert_no_fallback, ember_compile, reports, repro


def _causal(b, h, q, kv):
    return q >= kv


def _sliding(window):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv <= window)

    return mask


def _alibi(heads):
    def score(s, b, h, q, kv):
        return s + torch.exp2(-((h + 1) * 8.0 / heads)) * (kv - q)

    return score


def _documents(doc):
    def mask(b, h, q, kv):
        return (doc[q] == doc[kv]) & (q >= kv)

    return mask


def _t5_bias(table, temperature):
    """T5's bucketed relative position bias, read from a captured [buckets, heads] table (and a
    captured 0-dim temperature, read whole)."""

    def score(s, b, h, q, kv):
        rel = kv - q
        near = rel.abs()
        far = (8 + torch.log(near.float() / 8) / 2.77 * 8).to(torch.int32).clamp(max=15)
        bucket = torch.where(near < 8, near, far) + (rel > 0).to(torch.int32) * 16
        return s * temperature + table[bucket, h]

    return score


def _case(name, B, H, S, heads_kv=None):
    """(score_mod, block_mask) of one named program."""
    if name == "causal":
        return None, create_block_mask(_causal, 1, 1, S, S, device="cpu")
    if name == "sliding":
        return None, create_block_mask(_sliding(S // 4), B, 1, S, S, device="cpu", BLOCK_SIZE=32)
    if name == "alibi":
        return _alibi(H), None
    if name == "document":
        doc = torch.randint(0, 4, (S,)).sort().values
        return None, create_block_mask(_documents(doc), 1, 1, S, S, device="cpu")
    if name == "t5":
        return _t5_bias(torch.randn(32, H), torch.tensor(0.9)), create_block_mask(_causal, 1, 1, S, S, device="cpu")
    raise ValueError(name)


def _check(name, backend, B, H, S, D, heads_kv=None, transpose_q=False, epilogue=False):
    heads_kv = heads_kv or H
    score_mod, block_mask = _case(name, B, H, S)
    q = torch.randn(B, S, H, D).transpose(1, 2) if transpose_q else torch.randn(B, H, S, D)
    k, v = torch.randn(B, heads_kv, S, D), torch.randn(B, heads_kv, S, D)
    enable_gqa = heads_kv != H

    def fn(q, k, v):
        out, lse = flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa, return_lse=True
        )
        return (out * 2 if epilogue else out), lse

    line = repro(case=name, backend=backend, shape=(B, H, S, D), heads_kv=heads_kv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention's "called without torch.compile"
        want = fn(q, k, v)
        with reports() as report:
            got = ember_compile(fn, backend)(q, k, v)
    assert_no_fallback(report, line)
    hosts = "\n".join(g.host_source for g in report.graphs)
    assert "flex_attention_kernel" in hosts, f"flex_attention ran as PyTorch's op\n{line}"
    assert_close(got[0], want[0], rtol=1e-4, atol=1e-5, what="out", line=line)
    assert_close(got[1], want[1], rtol=1e-4, atol=1e-5, what="lse", line=line)
    assert got[0].stride() == want[0].stride(), f"out laid out {got[0].stride()}, eager {want[0].stride()}\n{line}"


@pytest.mark.parametrize("name", ["causal", "sliding", "alibi", "document", "t5"])
def test_flex_attention_cpp(name):
    # 200 is no multiple of the blocks: the last block of keys and of queries is partial. T5's case
    # also takes GQA (two query heads a key head) and a query whose heads are not its outer dim.
    # Causal's also has an ember kernel after the attention in the same graph.
    more = {"heads_kv": 2, "transpose_q": True} if name == "t5" else {"epilogue": name == "causal"}
    _check(name, "cpp", B=2, H=4, S=200, D=32, **more)


def test_flex_attention_triton_interpreted():
    # (The backward tests below run the forward kernel too, with GQA, score_mod and a document mask.)
    _check("sliding", "triton", B=2, H=2, S=80, D=16)


def _softcap(s, b, h, q, kv):
    return 5 * torch.tanh(s / 5)


@pytest.mark.parametrize("name", ["t5", "softcap_document", "softcap_document_two_kernels", "t5_no_block_mask"])
def test_flex_attention_backward_triton_interpreted(name, monkeypatch):
    """ember's backward kernels (float32: dk, dv and dq added up atomically; with the setting off, dq
    in a kernel of its own), the gradient through score_mod inlined from the joint graph, GQA, against
    PyTorch's reference backward. Eager flex_attention refuses a backward on CPU tensors before any
    kernel runs; its reference implementation computes one, so that guard is lifted here, for this
    test only."""
    from unittest import mock

    import torch.nn.attention.flex_attention as flex_module

    import ember.backends.flex as flex_backend

    ways = []
    init = flex_backend.FlexBackwardKernel.__init__

    def record(self, *args):
        init(self, *args)
        ways.append(self.atomic_dq)

    monkeypatch.setattr(flex_backend.FlexBackwardKernel, "__init__", record)
    atomic = not name.endswith("_two_kernels")

    # The document cases: 72 tokens (no multiple of the 16-wide tiles: a last partial block of keys and of
    # queries, which the atomic dq bounds) and a query whose heads are not its outer dim (dq's layout).
    B, H, S, D = 1, 2, 72 if name.startswith("softcap") else 80, 16
    tiles = ""
    if name == "t5":
        score_mod, block_mask = _case("t5", B, H, S)
    elif name == "t5_no_block_mask":
        # One block over the sequence, walked in 16-wide tiles: 5 steps a block, so every kernel takes
        # its block-by-block loop (flex_triton.block_walk) rather than the flat one.
        score_mod, _ = _case("t5", B, H, S)
        block_mask, tiles = None, "flex.float32=16x16x4,flex.backward_float32=16x16x4"
    else:
        doc = torch.randint(0, 3, (S,)).sort().values
        score_mod = _softcap
        block_mask = create_block_mask(_documents(doc), 1, 1, S, S, device="cpu", BLOCK_SIZE=32)

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=True)

    line = repro(case=name, backend="triton", shape=(B, H, S, D), heads_kv=1)
    if name.startswith("softcap"):
        q = torch.randn(B, S, H, D).transpose(1, 2).requires_grad_()
    else:
        q = torch.randn(B, H, S, D, requires_grad=True)
    k, v = (torch.randn(B, 1, S, D, requires_grad=True) for _ in range(2))
    with mock.patch.object(flex_module, "_validate_device", lambda *args: None), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = fn(q, k, v)
        grad = torch.randn_like(out)
        want = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
        with reports() as report, ember.config.override(heuristics=tiles, flex_atomic_dq=atomic):
            out = ember_compile(fn, "triton")(q, k, v)
            got = [out.detach(), *torch.autograd.grad(out, (q, k, v), grad)]
    assert_no_fallback(report, line)
    hosts = "\n".join(g.host_source for g in report.graphs)
    assert "flex_attention_backward_kernel" in hosts, f"the backward ran as PyTorch's op\n{line}"
    if block_mask is None:  # the BlockMask torch builds in the graph is folded: the forward launches flex alone
        forward = next(g for g in report.graphs if g.kind == "forward")
        computed = [e for e in forward.externs if not e.startswith("constant ")]
        assert not forward.kernels and computed == ["flex_attention"], (forward.kernels, computed, line)
    assert ways == [atomic], (ways, line)
    for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert_close(a, b, rtol=1e-4, atol=1e-5, what=what, line=line)


def test_flex_backward_adds_dq_atomically_for_float32_only_and_never_under_deterministic_algorithms():
    from ember.backends.flex import atomic_dq
    from ember.ir.flex import FlexSpec

    def spec(dtype):
        return FlexSpec(dtype, torch.float32, 64, 64, 0.125, None, None, (), 128, 128, False)

    assert atomic_dq(spec(torch.float32))
    assert not atomic_dq(spec(torch.bfloat16)) and not atomic_dq(spec(torch.float16))
    with ember.config.override(flex_atomic_dq=False):
        assert not atomic_dq(spec(torch.float32))
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not atomic_dq(spec(torch.float32))
    finally:
        torch.use_deterministic_algorithms(was)


def test_flex_attention_function_ember_cannot_map_runs_as_pytorch_op():
    """A score_mod using an op the tracer has no mapping for keeps PyTorch's op for that call, with one
    warning naming the op; the graph still compiles and the answer is eager's."""

    def signed(s, b, h, q, kv):
        return s + torch.sign(s) * 0.1

    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))

    def fn(q, k, v):
        return flex_attention(q, k, v, score_mod=signed)

    line = repro(case="sign score_mod", backend="cpp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = fn(q, k, v)
        with reports() as report:
            got = ember_compile(fn, "cpp")(q, k, v)
    assert_no_fallback(report, line)
    notes = [str(w.message) for w in caught if "flex_attention runs as PyTorch's op" in str(w.message)]
    assert len(notes) == 1 and "sign" in notes[0], f"{notes}\n{line}"
    assert_close(got, want, rtol=1e-5, atol=1e-6, what="out", line=line)


def test_flex_attention_cpp_dynamic_shapes():
    """Under dynamic=True the sequence lengths and the BlockMask's block sizes are symbols: the kernel
    reads them per call (blocks of 48, no power of two, tiled by 16)."""

    def fn(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask)

    compiled = ember_compile(fn, "cpp", dynamic=True)
    for S in (96, 160):
        q, k, v = (torch.randn(2, 2, S, 16) for _ in range(3))
        block_mask = create_block_mask(_causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=48)
        line = repro(case="causal dynamic", backend="cpp", seq=S)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            want = fn(q, k, v, block_mask)
            with reports() as report:
                got = compiled(q, k, v, block_mask)
        assert_no_fallback(report, line)
        assert all("flex_attention_kernel" in g.host_source for g in report.graphs), line
        assert_close(got, want, rtol=1e-4, atol=1e-5, what="out", line=line)


@pytest.mark.parametrize("dynamic, block", [(True, 48), (False, 40)])
def test_flex_attention_triton_block_sizes_it_cannot_tile_keep_pytorchs_op(dynamic, block):
    """Triton's tiles divide the BlockMask's blocks and are 16 at least: blocks that vary between calls
    (dynamic shapes), or whose power-of-two divisor is below 16 (40 = 8 * 5), keep PyTorch's op, with
    one warning, and match eager."""

    def fn(q, k, v, block_mask):
        return flex_attention(q, k, v, block_mask=block_mask)

    compiled = ember_compile(fn, "triton", dynamic=dynamic)
    S = 2 * block
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    block_mask = create_block_mask(_causal, 1, 1, S, S, device="cpu", BLOCK_SIZE=block)
    line = repro(case="causal", backend="triton", dynamic=dynamic, block=block)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        want = fn(q, k, v, block_mask)
        with reports() as report:
            got = compiled(q, k, v, block_mask)
    assert_no_fallback(report, line)
    notes = [str(w.message) for w in caught if "flex_attention runs as PyTorch's op" in str(w.message)]
    assert len(notes) == 1 and "Triton" in notes[0], f"{notes}\n{line}"
    assert_close(got, want, rtol=1e-5, atol=1e-6, what="out", line=line)


def test_flex_kernel_reads_a_table_by_head_once_and_gathers_per_score_with_its_own_tile(monkeypatch):
    """A captured tensor read by head alone (ALiBi's slopes) is loaded before the key loop; one read
    per score (T5's bias by bucket) stays in it and takes the Target's `gathering` tile."""
    from dataclasses import replace

    import ember.backends.flex as flex_backend
    from ember.target import FlexHeuristics, Target

    made = []
    init = flex_backend.FlexKernel.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(flex_backend.FlexKernel, "__init__", record)
    S = 64
    slopes = torch.rand(2)
    table = torch.randn(32, 2)
    q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
    programs = {
        "slopes": lambda s, b, h, i, j: s + slopes[h] * (j - i),
        "t5": _t5_bias(table, torch.tensor(1.0)),
    }
    for name, score in programs.items():
        line = repro(case=name, backend="triton", shape=(1, 2, S, 16))
        fn = lambda q, k, v, score=score: flex_attention(q, k, v, score_mod=score)
        with reports() as report:
            got = ember_compile(fn, "triton")(q, k, v)
        assert_no_fallback(report, line)
        assert_close(got, fn(q, k, v), rtol=1e-4, atol=1e-5, what="out", line=line)
    slope_kernel, t5_kernel = made
    # The loop form is the host's constant (a Python value here would pick one form for every call).
    assert "    if not KV_NESTED:\n" in slope_kernel.source, slope_kernel.source
    loop = slope_kernel.source.index("for it in range")
    assert 0 < slope_kernel.source.index("tl.load(BUF0") < loop, slope_kernel.source
    # (BUF0 is the 0-dim temperature, read once too; BUF1 the table.)
    assert t5_kernel.source.index("tl.load(BUF0") < t5_kernel.source.index("for it in range"), t5_kernel.source
    assert t5_kernel.source.index("tl.load(BUF1") > t5_kernel.source.index("for it in range"), t5_kernel.source
    # (The interpreter's float32 kernels take the float32 tile; the GPU's bf16 ones, by what they read.)
    gpu = Target("triton")
    tiles = [flex_backend.forward_launch(replace(k.spec, dtype=torch.bfloat16), gpu) for k in made]
    small, gathering = FlexHeuristics().small, FlexHeuristics().gathering
    assert [(t.block_m, t.block_n, t.warps) for t in tiles] == [
        (small.xblock, small.rblock, small.warps),
        (gathering.xblock, gathering.rblock, gathering.warps),
    ]


def test_flex_triton_float64_keeps_double_precision_and_lengths_share_one_kernel(monkeypatch):
    """The softmax scale is written into the kernel in double precision (a float argument would be
    rounded to fp32: 5e-8 off in fp64); sequence lengths under dynamic shapes without a BlockMask
    pass their step count as an argument, so they share one compiled kernel per loop form."""
    from ember.backends import direct_launch

    q, k, v = (3 * torch.randn(1, 2, 32, 16, dtype=torch.float64) for _ in range(3))
    block_mask = create_block_mask(_causal, 1, 1, 32, 32, device="cpu", BLOCK_SIZE=16)
    fn = lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        err = (ember_compile(fn, "triton")(q, k, v) - fn(q, k, v)).abs().max().item()
    assert err < 1e-12, err

    launched = []
    launch_fitting = direct_launch.launch_fitting

    def record(fn, grid, tensors, scalars, consts, launch):
        launched.append(tuple(consts.items()))
        return launch_fitting(fn, grid, tensors, scalars, consts, launch)

    monkeypatch.setattr(direct_launch, "launch_fitting", record)
    fn = lambda q, k, v: flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: s + (i - j) * 0.1)
    compiled = ember_compile(fn, "triton", dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for S in (80, 96, 112):  # 5, 6 and 7 steps of 16 keys: the block-by-block walk each time
            q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
            with ember.config.override(heuristics="flex.float32=16x16x4"):
                assert_close(compiled(q, k, v), fn(q, k, v), rtol=1e-4, atol=1e-5, what="out", line=f"S={S}")
    assert len(set(launched)) == 1, launched


@pytest.mark.parametrize("scale", [-0.3, 0.0, 1e-46, 0.25])
def test_flex_triton_any_softmax_scale_matches_eager(scale):
    """The forward applies a positive scale's base-2 factor after the row maximum (it commutes with it);
    a negative or zero scale, or one whose factor is no normal float32, keeps it per score, before the
    maximum and the mask (a zero factor times a masked score's -inf would be NaN)."""
    q, k, v = (torch.randn(1, 2, 64, 16) for _ in range(3))
    block_mask = create_block_mask(_causal, 1, 1, 64, 64, device="cpu", BLOCK_SIZE=16)
    fn = lambda q, k, v: flex_attention(q, k, v, block_mask=block_mask, scale=scale)
    line = repro(program="causal flex_attention", scale=scale, q="f32[1, 2, 64, 16]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = ember_compile(fn, "triton")(q, k, v)
    assert_close(got, fn(q, k, v), rtol=1e-4, atol=1e-5, what="out", line=line)
