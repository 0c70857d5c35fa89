"""The bench's host, optimizer, training-loop, decoding and JAX workloads at tiny scale on the CPU: each builds,
eager matches its float64 reference, ember matches it too, and the new columns (host µs per call,
GPU-busy fraction, Inductor in ember's mode) reach the table. No timed assertions."""

from __future__ import annotations

import importlib.util
import types

import pytest
import torch

from ember.tools.bench import host_cost, jax_step, measure, optimizers, report
from ember.tools.bench.__main__ import _compilers
from ember.tools.bench.__main__ import main as bench_main
from ember.tools.bench.workloads import WORKLOADS, select
from tests.helpers import assert_no_fallback, ember_compile, reports, repro

CPU = torch.device("cpu")


@pytest.mark.parametrize("name", ["opt_adamw", "opt_adam_gpt2", "opt_sgd_momentum_gpt2"])
def test_optimizer_step_matches_its_float64_reference(name):
    w = WORKLOADS[name]
    built = w.instance("tiny", CPU, "step")
    ref = built.reference()
    built.reset()
    got = measure.Step(built.fn, False, None, CPU)()
    err = measure.max_err(got, ref)
    tol = 1e-5 if w.dtype == "f32" else 1e-2  # one rounding of the parameters' dtype
    assert err <= tol, f"{name}: max rel err {err:.2e} > {tol:.0e}  {repro(workload=name)}"
    built.reset()  # puts the state back: the same step gives the same parameters
    again = measure.Step(built.fn, False, None, CPU)()
    assert all(torch.equal(a, b) for a, b in zip(got, again)), repro(workload=name, case="reset")


def test_optimizer_floor_counts_params_grads_and_states():
    # AdamW over 4 × 64 fp32: param, exp_avg, exp_avg_sq read and written, the gradient read.
    built = WORKLOADS["opt_adamw"].instance("tiny", CPU, "step")
    assert built.bytes == 4 * 64 * 4 * (2 * 3 + 1), built.bytes
    assert sum(torch.Size(s).numel() for s in optimizers.gpt2_shapes()) == 124_439_808  # GPT-2 124M


def test_flex_rows_at_three_sequence_lengths_with_the_same_tokens():
    for name in ("flex_causal", "flex_causal_d128", "flex_sliding", "flex_alibi", "flex_document", "flex_relative",
                 "flex_sdpa_causal", "flex_sdpa_causal_d128"):  # fmt: skip
        sizes = {suffix: WORKLOADS[name + suffix].sizes["gpu"] for suffix in ("_s1k", "", "_s16k")}
        d = 128 if name.endswith("_d128") else 64
        assert sizes == {"_s1k": (16, 16, 1024, d), "": (4, 16, 4096, d), "_s16k": (1, 16, 16384, d)}, name
        assert all(WORKLOADS[name + suffix].group == "flex" for suffix in sizes), name
    for name in ("gpt2_flex", "gpt2_sdpa"):
        w = WORKLOADS[name]
        assert w.group == "flex" and w.modes == ("inference", "train"), w
        assert w.sizes == WORKLOADS["gpt2_step"].sizes, name  # gpt2_step's model: 4 blocks, 8 × 1024 × 768
    assert [c.key for c in select("gpt2_flex", "train")] == ["gpt2_flex/train"]


def test_long_flex_rows_run_eager_a_block_of_queries_at_a_time(monkeypatch):
    """Eager flex_attention materializes [B, H, S, S] scores: past EAGER_SCORES elements eager runs
    blocks of queries (the score_mod and mask_mod shifted to the block's queries), the same answer,
    while a compiler traces the one whole call."""
    import warnings

    from ember.tools.bench import flex_workloads

    build, _ = flex_workloads.PROGRAMS["flex_relative"]  # a score_mod and a BlockMask
    size = (1, 2, 200, 16)  # blocks of 50 queries: none a multiple of the BlockMask's 128
    torch.manual_seed(0)
    whole = build(size, CPU)
    monkeypatch.setattr(flex_workloads, "EAGER_SCORES", 2 * 50 * 200)
    torch.manual_seed(0)
    blocks = build(size, CPU)
    q, k, v = (x.float() for x in whole.inputs)
    line = repro(workload="flex_relative", size=size, query_blocks=4)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention's "called without torch.compile"
        want = whole.fn(q, k, v)
        torch.testing.assert_close(blocks.fn(q, k, v), want, rtol=1e-5, atol=1e-5, msg=lambda m: f"{m}\n{line}")
        with reports() as report:
            got = ember_compile(blocks.fn, "cpp")(q, k, v)
    assert_no_fallback(report, line)
    calls = [ln for g in report.graphs for ln in g.host_source.splitlines() if "= flex_attention_kernel" in ln]
    assert len(calls) == 1, f"{calls}\n{line}"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{m}\n{line}")


def test_gpt2_flex_forward_matches_eager_and_attends_in_embers_kernel():
    """gpt2_flex at tiny scale (its attention flex_attention with a causal BlockMask, the SDPA twin's
    weights): eager's output is the SDPA model's, and ember's is eager's, its attention ember's kernel."""
    import warnings

    flex = WORKLOADS["gpt2_flex"].instance("tiny", CPU, "inference")
    sdpa = WORKLOADS["gpt2_sdpa"].instance("tiny", CPU, "inference")
    sdpa.fn.load_state_dict(flex.fn.state_dict())
    line = repro(workload="gpt2_flex", scale="tiny")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager flex_attention's "called without torch.compile"
        want = flex.fn(*flex.inputs)
        torch.testing.assert_close(want, sdpa.fn(*flex.inputs), rtol=2e-2, atol=2e-2, msg=lambda m: f"{m}\n{line}")
        with reports() as report:
            got = ember_compile(flex.fn, "cpp")(*flex.inputs)
    assert_no_fallback(report, line)
    assert any("flex_attention_kernel" in g.host_source for g in report.graphs), (
        f"attention ran as PyTorch's op\n{line}"
    )
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2, msg=lambda m: f"{m}\n{line}")


def test_hundred_kernel_program_makes_about_a_hundred_kernels():
    import ember

    with torch.no_grad():
        (graph,) = ember.explain(host_cost.hundred_kernels, torch.randn(8, 8)).graphs
    assert len(graph.kernels) >= 100, len(graph.kernels)


def test_graph_call_skips_dynamo_and_gives_the_programs_result():
    x = torch.randn(64)
    call = host_cost.graph_call(host_cost.one_kernel, "ember", (x,), train=False)
    with torch.no_grad():
        (got,) = call()
    torch.testing.assert_close(got, host_cost.one_kernel(x))
    assert host_cost.graph_call(host_cost.one_kernel, "ember", (x,), train=True) is None


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = [
        "--scale", "tiny", "--device", "cpu", "--workloads", "host_1k,opt_sgd_momentum,llama_decode,gpt2_loop",
        "--compile-time", "none", "--cpu-budget-s", "0.02", "--rounds", "1", "--no-inductor", "--out", str(out),
    ]  # fmt: skip
    assert bench_main(argv) == 0, "a compiled output did not match eager"
    return report.load_jsonl([str(out / "results.jsonl")])


def test_host_and_optimizer_rows(records):
    cases = {r["case"]: r for r in records if r["type"] == "case"}
    host = cases["host_1k/inference"]["compilers"]
    for name in ("eager", "ember"):  # Inductor's column: test_bench's run covers Inductor beside ember
        assert host[name]["graph_host_us"] > 0, host[name]
        assert host[name]["busy_ms"] is None  # no GPU here
    opt = cases["opt_sgd_momentum/step"]
    assert opt["limit"]["bytes"] == 4 * 64 * 4 * (2 * 2 + 1), opt["limit"]
    assert opt["compilers"]["ember"]["status"] == "ok", opt["compilers"]["ember"]
    decode = cases["llama_decode/decode"]
    if importlib.util.find_spec("transformers") is None:
        assert "transformers not importable" in decode["skipped"], decode
    else:
        assert decode["compilers"]["ember"]["tokens_matching"], decode
    loop = cases["gpt2_loop/loop"]["compilers"]
    assert loop["ember"]["status"] == "ok" and len(loop["ember"]["losses"]) == 20, loop["ember"]
    assert loop["ember"]["losses"] != loop["eager"]["losses"][:1] * 20  # the loop trains: losses change
    header, _, _ = report.table_rows(report.Run.of(records))
    assert "host µs ember" in header and "% GPU busy ember" in header, header


def test_jax_column_says_why_it_is_missing():
    case = types.SimpleNamespace(workload=WORKLOADS["gpt2_step"])
    settings = types.SimpleNamespace(scale="tiny", compile_timeout_s=300)
    (result,) = jax_step.others(case, settings).values()
    if importlib.util.find_spec("jax") is None:
        assert result == {"status": "skipped", "note": "jax not importable here"}
    else:
        assert result["status"] == "ok" and result["ms"] > 0, result


def test_each_ember_mode_has_inductor_in_that_mode_beside_it():
    args = types.SimpleNamespace(no_inductor=False, max_autotune=False, ember_modes="default,reduce-overhead", peers="")
    compilers = _compilers(args)
    assert compilers == ["inductor", "inductor:reduce-overhead", "ember", "ember:reduce-overhead"], compilers
    args.ember_modes, args.peers = "default,freezing", "onnxruntime"
    assert _compilers(args) == ["inductor", "inductor:freezing", "ember", "ember:freezing", "onnxruntime"]
    args.peers = "tvm"
    with pytest.raises(SystemExit, match="unknown"):
        _compilers(args)
    assert report.baseline("ember:reduce-overhead", compilers) == "inductor:reduce-overhead"
    assert report.baseline("ember", compilers) == "inductor"
    case = {"compilers": {"inductor:reduce-overhead": {"status": "ok", "ms": 2.0}, "ember:reduce-overhead": {
        "status": "ok", "ms": 1.0, "busy_ms": 0.8}}}  # fmt: skip
    assert report.versus(case, "ember:reduce-overhead", "inductor:reduce-overhead") == 2.0
    assert report.busy_fraction(case, "ember:reduce-overhead") == 0.8


def test_own_modes_are_selected_with_the_default_modes():
    keys = [c.key for c in select("optim,llama_decode_b8")]
    assert "opt_adamw/step" in keys and "opt_sgd_momentum_gpt2/step" in keys and "llama_decode_b8/decode" in keys


def test_decode_tokens_are_checked_against_eagers_for_every_compiler():
    from ember.tools.bench.decode import check_tokens

    results = {
        "eager": {"ms": 1.0, "tokens": [[5, 6, 7]]},
        "inductor": {"ms": 0.9, "tokens": [[5, 6, 7]]},
        "ember": {"ms": 0.8, "tokens": [[5, 9, 7]]},
        "ember:reduce-overhead": {"status": "error", "note": "timed out"},
    }
    checked = check_tokens(results)
    assert checked["inductor"]["status"] == "ok" and checked["inductor"]["tokens_matching"] == "3/3"
    assert checked["ember"]["status"] == "mismatch" and "position 1" in checked["ember"]["note"], checked["ember"]
    assert checked["ember:reduce-overhead"]["status"] == "error"
    assert all("tokens" not in r for r in checked.values())


def test_decode_status_comes_from_the_logits_under_the_float64_rule():
    from ember.tools.bench.decode import check_logits, check_tokens

    reference = torch.linspace(-4, 4, 24, dtype=torch.float32).reshape(1, 3, 8)
    near, far = reference + 0.01, reference + 1.0
    results = {
        "eager": {"ms": 1.0, "tokens": [[1, 2, 3]]},
        "inductor": {"ms": 0.9, "tokens": [[1, 5, 3]]},  # another greedy token, logits as close as eager's
        "ember": {"ms": 0.8, "tokens": [[1, 2, 3]]},  # the same tokens, logits far off
    }
    logits = {"eager": {"logits": near, "reference": reference}, "inductor": {"logits": near}, "ember": {"logits": far}}
    checked = check_logits(check_tokens(results), logits)
    assert checked["inductor"]["status"] == "ok" and "2/3" in checked["inductor"]["note"], checked["inductor"]
    assert checked["ember"]["status"] == "mismatch" and "logits" in checked["ember"]["note"], checked["ember"]
    assert checked["eager"]["status"] == "ok", checked["eager"]
