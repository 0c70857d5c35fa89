"""`gpt2_loop`: a whole training loop, the model and the optimizer step both compiled.

What users write: `model = torch.compile(model)`, `opt.step = torch.compile(opt.step)`, and a
Python loop of forward, backward, step and `zero_grad`. The model is the GPT-2-block stack of
`gpt2_step` (bf16 parameters), the optimizer AdamW in its foreach form (bf16 states, as torch.optim
keeps them beside bf16 parameters), the loss the mean square of the final layer norm's output
computed in float32.

Correctness: every compiler trains its own copy of the same initial model for `STEPS` steps from
the same state; the losses are compared with a float64 run of the same loop (float64 parameters,
single-tensor AdamW) under the project's rule: a compiled run may be as far from the float64 losses
as eager is, twice, plus rounding slack (`measure.tolerance`). The final parameters' error is
recorded beside it.

Timing: one step (forward, backward, optimizer step, `zero_grad`) as `measure.Timer` times a call,
the median over the rounds, which take turns; the GPU's busy time per step from torch.profiler.
"""

from __future__ import annotations

import statistics

import torch

from ember.tools import workloads as programs
from ember.tools.bench import measure
from ember.tools.bench.compilers import compile_fn

STEPS = 20
_LR = 1e-3


def describe(size: tuple) -> str:
    b, t, d, _, layers = size
    return f"{layers} blocks, {b}×{t}×{d}, AdamW, {STEPS} steps checked"


class _Loop:
    """One model and its optimizer, the forward and `opt.step` compiled by `compiler`."""

    def __init__(self, model: torch.nn.Module, x: torch.Tensor, compiler: str, foreach: bool = True):
        self.model, self.x = model, x
        self.opt = torch.optim.AdamW(model.parameters(), lr=_LR, foreach=foreach)
        self.forward = compile_fn(model, compiler)
        self.opt_step = compile_fn(self.opt.step, compiler)

    def step(self) -> torch.Tensor:
        # A new iteration: outputs of CUDA graphs replayed in the last one may be overwritten (the
        # documented rule of torch.compile's reduce-overhead mode; a no-op without CUDA graphs).
        torch.compiler.cudagraph_mark_step_begin()
        loss = self.forward(self.x).float().square().mean()
        loss.backward()
        self.opt_step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()

    def losses(self, n: int) -> torch.Tensor:
        return torch.stack([self.step() for _ in range(n)]).double()

    def params(self) -> list[torch.Tensor]:
        return [p.detach() for p in self.model.parameters()]


def _build(size: tuple, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    b, t, d, heads, layers = size
    torch.manual_seed(0)
    model = programs.GPT2Stack(d, heads, layers).to(device)
    x = torch.randn(b, t, d, device=device)
    return model, x


def run(case, s, record: dict, ceilings: dict) -> dict:
    """Eager and each compiler: `STEPS` checked steps, then timed steps (taking turns)."""
    size = case.workload.sizes[s.scale]
    base, x = _build(size, s.device)
    # The float64 run starts from the bf16 run's initial values.
    reference = _Loop(base.to(torch.bfloat16).double(), x.to(torch.bfloat16).double(), "eager", foreach=False)
    reference = reference.losses(STEPS)
    del base
    loops, results = {}, {}
    for compiler in ["eager", *s.compilers]:
        s.progress(f"{case.key}: {compiler}")
        model, x = _build(size, s.device)
        loop = _Loop(model.to(torch.bfloat16), x.to(torch.bfloat16), compiler)
        try:
            losses = loop.losses(STEPS)
        except Exception as e:  # noqa: BLE001 - a compiler that crashes is a result, not the end of the run
            results[compiler] = {"status": "error", "note": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        err = measure.max_err([losses], [reference])
        results[compiler] = {"err": err, "losses": [round(v, 6) for v in losses.tolist()]}
        loops[compiler] = loop
    if "eager" not in loops:
        record["error"] = f"eager: {results['eager']['note']}"
        return record
    tol = measure.tolerance(torch.bfloat16, results["eager"]["err"])
    record["eager_err"] = results["eager"]["err"]
    for compiler, r in results.items():
        if "err" not in r:
            continue
        r["tol"] = tol
        if r["err"] <= tol:
            r["status"] = "ok"
        else:
            r.update(status="mismatch", note=f"losses: max rel err {r['err']:.2e} > tol {tol:.2e}")
            loops.pop(compiler)
    _time(loops, results, s)
    record["compilers"] = results
    record["limit"] = {"bytes": 0, "flops": 0}
    return record


def _time(loops: dict[str, _Loop], results: dict, s) -> None:
    times: dict[str, list] = {name: [] for name in loops}
    names = list(loops)
    for r in range(s.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            s.timer.last = None
            ms = s.timer.median_ms(loops[name].step)
            times[name].append((ms, s.timer.last))
    for name, timed in times.items():
        result = results[name]
        result["ms"] = statistics.median(ms for ms, _ in timed)
        parts = [p for _, p in timed if p]
        if parts:
            result["device_ms"] = statistics.median(p["device_ms"] for p in parts)
            result["host_ms"] = statistics.median(p["host_ms"] for p in parts)
        result["busy_ms"] = measure.busy_ms(loops[name].step, [()], s.device)
