"""Dynamic shapes: one compiled program called at many sizes (`--workloads dynamic`).

    ember bench --workloads dyn_gpt2_block,dyn_convnet --rounds 3

Two workloads, inference:

- `dyn_gpt2_block`: one GPT-2 block (ember/tools/workloads.py's `GPT2Block`, bf16) at 16 sequence
  lengths from 64 to 1024 ("gpu" scale), 7 of them not multiples of 16;
- `dyn_convnet`: ResNet-18 (ember/tools/workloads.py's `ResNet`, basic blocks, random batch-norm
  statistics, under bf16 autocast) at batch sizes 1, 3, 8, 17, 32 and 64 (224²).

For eager and each compiler, the program is compiled once with torch's default `dynamic=None`
(automatic dynamic: the first size compiles static, a change of size compiles again with that
dimension symbolic) and called at every size in turn, in the order listed. Each first call is
timed (their sum is the compile time) and its outputs checked against a float64 reference under the
float64 rule (accuracy.py: allclose to eager, or RMSE to float64 at most 3× eager's for bf16 plus
tol/10). Then every size is timed as the other rows are (`measure.Timer`, inputs rotated among
copies where they fit in the cache), eager and the compilers taking turns in `--rounds` rounds.

Graphs compiled: the growth of `torch._dynamo.utils.counters["stats"]["unique_graphs"]` over a
compiler's calls at every size, which Dynamo counts once per graph it hands a backend (a frame
compiled without a graph break: one). The count is also taken around each timed measurement, so a
recompile while timing is seen and reported. Each compiler calls the program through an entry
function with a code object of its own (`_entry`): Dynamo keeps compiled versions and the
automatic-dynamic record of which sizes changed per code object, so each compiler starts static,
as in a fresh process, while the others' compiled versions stay in place for the rounds.

One record per workload (type "case", kind "dynamic"): per compiler the graphs compiled, the
compile time, Dynamo's recompile reasons, and per size the first call's time, the float64 check and
the steady-state time; "ms" is the geometric mean over sizes of the steady-state times (and
"ms_rounds" that of each round), so Inductor ms ÷ ember ms is the geometric mean over sizes of the
per-size ratios.
"""

from __future__ import annotations

import copy
import gc
import itertools
import math
import re
import statistics
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch._dynamo
from torch import nn

from ember.tools import workloads as programs
from ember.tools.bench import float64_rule, measure
from ember.tools.bench.compilers import PEERS, compile_fn

# (batch, width, heads, sequence lengths), in the order they are called.
GPT2_SIZES = {
    "gpu": (8, 768, 12, (64, 100, 128, 200, 256, 300, 384, 447, 512, 600, 640, 700, 768, 833, 960, 1024)),
    "cpu": (2, 256, 4, (16, 24, 32, 45, 64, 77, 96, 111, 128, 150, 160, 190, 200, 224, 250, 256)),
    "tiny": (2, 32, 2, (8, 13, 16, 24, 37)),
}
# (resolution, stem width, stage widths, blocks per stage, batch sizes), in the order they are called.
CONV_SIZES = {
    "gpu": (224, 64, (64, 128, 256, 512), (2, 2, 2, 2), (1, 3, 8, 17, 32, 64)),
    "cpu": (64, 64, (64, 128, 256, 512), (2, 2, 2, 2), (1, 3, 8, 17)),
    "tiny": (16, 8, (8, 16), (1, 1), (1, 2, 3, 5)),
}


@dataclass
class Sweep:
    """One program and its inputs at each size."""

    model: nn.Module
    inputs: list[tuple]  # one tuple of inputs per size
    sizes: list[int]
    varying: str  # what the sizes are: "sequence length", "batch"
    autocast: torch.dtype | None = None


def _gpt2_block(size: tuple, device: torch.device) -> Sweep:
    batch, width, heads, lengths = size
    model = programs.GPT2Block(width, heads).to(device=device, dtype=torch.bfloat16)
    inputs = [(torch.randn(batch, t, width, device=device, dtype=torch.bfloat16),) for t in lengths]
    return Sweep(model, inputs, list(lengths), "sequence length")


def _convnet(size: tuple, device: torch.device) -> Sweep:
    res, stem, widths, depths, batches = size
    model = programs.ResNet(stem, widths, depths).to(device)
    with torch.no_grad():  # batch norm's statistics and affine terms away from 0 and 1, so they count
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.normal_(1.0, 0.1)
                m.bias.normal_(0.0, 0.1)
    inputs = [(torch.randn(b, 3, res, res, device=device),) for b in batches]
    return Sweep(model, inputs, list(batches), "batch", autocast=torch.bfloat16)


def _describe_gpt2(size: tuple) -> str:
    batch, width, heads, lengths = size
    return f"GPT-2 block, batch {batch}, d {width}, {heads} heads; {len(lengths)} lengths {min(lengths)}–{max(lengths)}"


def _describe_conv(size: tuple) -> str:
    res, _, widths, depths, batches = size
    blocks = "-".join(map(str, depths))
    return f"ResNet {blocks} basic blocks, {widths[0]}–{widths[-1]} wide, {res}²; batch {', '.join(map(str, batches))}"


# name: (dtype as the table shows it, sizes, build, optional package, describe)
PROGRAMS: dict[str, tuple] = {
    "dyn_gpt2_block": ("bf16", GPT2_SIZES, _gpt2_block, None, _describe_gpt2),
    "dyn_convnet": ("bf16 autocast", CONV_SIZES, _convnet, None, _describe_conv),
}


def workloads(workload) -> list:
    """The group's workloads, made by the bench's `Workload`; each measures itself (`runner=run`)."""
    return [
        workload(
            name, "dynamic", dtype, sizes, None, modes=("dynamic",), requires=requires, describe=describe, runner=run
        )
        for name, (dtype, sizes, _, requires, describe) in PROGRAMS.items()
    ]


def graphs_compiled() -> int:
    """Graphs Dynamo has handed a backend in this process (its own counter)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def graph_breaks() -> int:
    """Graph breaks Dynamo has met in this process (its own counter, by reason)."""
    from torch._dynamo.utils import counters

    return int(sum(counters["graph_break"].values()))


_entries = itertools.count()


def _entry(model: nn.Module, compiler: str) -> Callable:
    """`model(*inputs)` through a function whose code object is this call's own (module docstring). Its
    name is unique in the process: Dynamo keys its automatic-dynamic record by file, line, name and
    closure, and its recompile reasons by code objects, which compare equal when only their closures
    differ."""

    def call(*inputs):
        return model(*inputs)

    name = "dynamic_" + re.sub(r"\W", "_", compiler) + f"_{next(_entries)}"
    code = call.__code__.replace(co_name=name)
    return types.FunctionType(code, call.__globals__, name, None, call.__closure__)


def _recompile_reasons(entry: Callable) -> list[str]:
    """Dynamo's reasons for compiling `entry` again (the first failing guard of each version), shortened."""
    from torch._dynamo.utils import guard_failures

    return [reason.splitlines()[0][:300] for reason in guard_failures.get(entry.__code__, [])]


def _float64(x):
    return x.detach().double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def run(case, s, record: dict, ceilings: dict) -> dict:
    """Eager and each compiler over every size: first calls (compile, check), then timed rounds."""

    w = case.workload
    _, _, build, _, _ = PROGRAMS[w.name]
    torch._dynamo.reset()
    try:
        torch.manual_seed(0)
        sweep = build(w.sizes[s.scale], s.device)
        sweep.model.eval()
        record.update(kind="dynamic", varying=sweep.varying, sizes=sweep.sizes)
        eager = measure.Step(sweep.model, False, sweep.autocast, s.device)
        reference = measure.Step(copy.deepcopy(sweep.model).double(), False, None, s.device)
        expected = [eager(*inputs) for inputs in sweep.inputs]
        float64 = [reference(*map(_float64, inputs)) for inputs in sweep.inputs]
        del reference
    except Exception as e:  # noqa: BLE001 - reported in the case's row
        record["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        record["trace"] = traceback.format_exc()[-2000:]
        return record
    tol = float64_rule.tolerance_for(case.workload.dtype != "f32", case.mode == "train")
    record["tol"] = tol
    steps: dict[str, measure.Step] = {}
    for compiler in ["eager", *s.compilers]:
        if compiler in PEERS:
            record["compilers"][compiler] = {"status": "skipped", "note": "runs the static shape it exported"}
            continue
        s.progress(f"{case.key}: {compiler}, {len(sweep.sizes)} sizes")
        result, step = _first_calls(compiler, sweep, expected, float64, tol, s.device)
        record["compilers"][compiler] = result
        if step is not None:
            steps[compiler] = step
    del expected, float64
    s.progress(f"{case.key}: timing {len(steps)} at {len(sweep.sizes)} sizes in {s.rounds} round(s)")
    _time(steps, sweep, record, s)
    del steps, sweep
    torch._dynamo.reset()
    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()
    return record


def _first_calls(compiler: str, sweep: Sweep, expected, float64, tol: float, device) -> tuple[dict, object]:
    """Compile once and call at every size: each first call's time and float64 check, the graphs
    compiled and Dynamo's reasons; the step to time (None: not timed)."""
    from ember.report import collecting

    entry = _entry(sweep.model, compiler)
    step = measure.Step(compile_fn(entry, compiler), False, sweep.autocast, device)
    result: dict = {"sizes": []}
    before, breaks = graphs_compiled(), graph_breaks()
    failed: list[str] = []
    with collecting() as report:
        for size, inputs, want, ref in zip(sweep.sizes, sweep.inputs, expected, float64):
            try:
                t0 = time.perf_counter()
                got = step(*inputs)
                measure.sync(device)
                first = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - a compiler that crashes is a result, not the end of the run
                result.update(
                    status="error",
                    note=f"{sweep.varying} {size}: {type(e).__name__}: {str(e)[:300]}",
                    trace=traceback.format_exc()[-2000:],
                )
                return result, None
            checks = [
                float64_rule.check_tensor(f"output {k}", g, e, r, tol)
                for k, (g, e, r) in enumerate(zip(got, want, ref))
            ]
            if len(got) != len(want):
                checks.append(
                    float64_rule.TensorCheck(
                        "outputs", False, f"{len(got)} outputs, eager {len(want)}", *(math.nan,) * 3
                    )
                )
            worst = max(checks, key=lambda c: (not c.passed, float64_rule.ratio(c)))
            result["sizes"].append(
                {
                    "size": size,
                    "first_call_s": first,
                    "float64": "pass" if worst.passed else "fail",
                    "worst": worst.record(),
                }
            )
            if not worst.passed:
                failed.append(f"{sweep.varying} {size}: {worst.name}: {worst.how}")
            del got
    if compiler != "eager":
        result["frames"] = graphs_compiled() - before
        result["graph_breaks"] = graph_breaks() - breaks
        result["recompile_reasons"] = _recompile_reasons(entry)
        limit = torch._dynamo.config.recompile_limit
        if result["frames"] >= limit:
            result["note"] = f"Dynamo's recompile limit ({limit}) was reached: later sizes may have run eagerly"
    result["compile_s"] = sum(r["first_call_s"] for r in result["sizes"])
    if compiler.startswith("ember"):
        result["kernels"] = sum(len(g.kernels) for g in report.graphs)
        result["externs"] = sum(len(g.externs) for g in report.graphs)
        result["fallbacks"] = [f"{g.kind}: {g.fallback}" for g in report.graphs if g.fallback]
    if failed:
        result.update(status="mismatch", note=f"float64 rule fails at {len(failed)} sizes; " + "; ".join(failed[:3]))
        return result, None
    result["status"] = "fell back" if result.get("fallbacks") else "ok"
    return result, step


def _time(steps: dict, sweep: Sweep, record: dict, s) -> None:
    """Each size timed for every step in `s.rounds` rounds that take turns (the order rotates each
    round); per size the median over the rounds; per compiler the geometric mean over sizes."""
    names = list(steps)
    cache = measure.cache_bytes(s.device)[0]
    for i, inputs in enumerate(sweep.inputs):
        input_sets = measure.copies_of(inputs, measure.rotations(inputs, cache))
        timed: dict[str, list] = {n: [] for n in names}
        for r in range(s.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                before = graphs_compiled()
                s.timer.last = None
                ms = s.timer.time_step(steps[name], input_sets)
                timed[name].append((ms, s.timer.last))
                grew = graphs_compiled() - before
                if grew:
                    result = record["compilers"][name]
                    result["recompiled_while_timing"] = result.get("recompiled_while_timing", 0) + grew
        for name, times in timed.items():
            per_size = record["compilers"][name]["sizes"][i]
            per_size["ms"] = statistics.median(ms for ms, _ in times)
            per_size["ms_rounds"] = [ms for ms, _ in times]
            parts = [p for _, p in times if p]
            if parts:  # GPU: the call's time is the larger of these two
                per_size["device_ms"] = statistics.median(p["device_ms"] for p in parts)
                per_size["host_ms"] = statistics.median(p["host_ms"] for p in parts)
        del input_sets
    for name in names:
        result = record["compilers"][name]
        result["ms"] = geomean([p["ms"] for p in result["sizes"]])
        result["ms_rounds"] = [geomean([p["ms_rounds"][r] for p in result["sizes"]]) for r in range(s.rounds)]
