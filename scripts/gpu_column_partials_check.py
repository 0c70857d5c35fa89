"""On the GPU: row kernels that also sum their rows' columns (kernel.KColumnPartial), checked and timed.

    PYTHONPATH=. python scripts/gpu_column_partials_check.py [--out results.jsonl]

Cases: a LayerNorm (gpt2_blocks' [16384, 768] bf16, and fp32 [8192, 768]) and an RMSNorm
(llama_block's [8192, 4096] bf16), each a forward and a backward step of a module. For each:
Inductor, then ember with the column sums in kernels of their own (`column_partial_programs=-1`)
and with them accumulated by the row kernel at several program counts. Each run is checked
against an fp32 reference (its error beside eager's in the same dtype) and timed by device time
per step (torch.profiler: every kernel of the forward and backward, no host time).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("EMBER_CACHE_DIR", tempfile.mkdtemp())


class RMSNorm(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


def _cases():
    return {
        "layernorm_bf16_16384x768": (lambda: torch.nn.LayerNorm(768), (16384, 768), torch.bfloat16),
        "layernorm_f32_8192x768": (lambda: torch.nn.LayerNorm(768), (8192, 768), torch.float32),
        "rmsnorm_bf16_8192x4096": (lambda: RMSNorm(4096), (8192, 4096), torch.bfloat16),
    }


def _step(model, x, g):
    """Forward and backward; returns the output and every gradient."""
    for p in model.parameters():
        p.grad = None
    x.grad = None
    out = model(x)
    out.backward(g)
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


def device_us(fn, calls: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / calls


def _max_err(a, ref):
    return (a.double() - ref.double()).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="column_partials.jsonl")
    p.add_argument("--programs", default="-1,132,264,528")
    args = p.parse_args()

    import ember
    from ember.frontend.backend import ember_backend

    dev = torch.device("cuda")
    rows = []
    for name, (make, shape, dtype) in _cases().items():
        torch.manual_seed(0)
        base = make().to(dev)
        with torch.no_grad():
            for prm in base.parameters():
                prm.normal_(1.0, 0.1)
        x0 = torch.randn(shape, device=dev)
        g0 = torch.randn(shape, device=dev)
        ref = _step(base.float(), x0.clone().requires_grad_(), g0)
        model = make().to(dev, dtype)
        model.load_state_dict(base.state_dict())
        x = x0.to(dtype).requires_grad_()
        g = g0.to(dtype)
        eager = _step(model, x, g)
        eager_err = [_max_err(a, r) for a, r in zip(eager, ref)]
        runs = [("inductor", None)] + [("ember", int(n)) for n in args.programs.split(",")]
        for compiler, programs in runs:
            torch._dynamo.reset()
            row = {"case": name, "compiler": compiler, "programs": programs}
            try:
                if compiler == "inductor":
                    compiled = torch.compile(model)
                    got = _step(compiled, x, g)
                    row["us"] = device_us(lambda c=compiled, x=x, g=g: _step(c, x, g))
                else:
                    # The setting by environment: CUDA's backward compiles on autograd's device
                    # thread, where a `config.override` of this thread does not reach.
                    os.environ["EMBER_COLUMN_PARTIAL_PROGRAMS"] = str(programs)
                    report = ember.explain(model, x)
                    row["backward_kernels"] = [len(gr.kernels) for gr in report.graphs if gr.kind == "backward"]
                    torch._dynamo.reset()
                    compiled = torch.compile(model, backend=ember_backend)
                    got = _step(compiled, x, g)
                    row["us"] = device_us(lambda c=compiled, x=x, g=g: _step(c, x, g))
                err = [_max_err(a, r) for a, r in zip(got, ref)]
                # As the test suite's rule: no worse than twice eager's error plus bf16's resolution.
                row["ok"] = all(
                    e <= 2 * ee + 2**-8 * max(1.0, r.abs().max().item()) for e, ee, r in zip(err, eager_err, ref)
                )
                row["max_err"] = err
                row["eager_err"] = eager_err
            except Exception as e:  # noqa: BLE001 - a failure is a result to record
                row["error"] = f"{type(e).__name__}: {e}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
