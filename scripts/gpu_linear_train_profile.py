"""On the GPU: where a Linear + bias + GELU training step spends its time, eager vs ember vs Inductor.

gelu(x @ w.T + b) forward and the gradients of x, w and b (torch.autograd.grad with a random
upstream gradient), bf16, for each shape M,N,K given: every GPU kernel of one warm step
(torch.profiler, averaged over a few steps), with the ATen op and its input shapes and strides
that launched it, so a slow product or a copy that eager does not make shows up by name.

    PYTHONPATH=. python scripts/gpu_linear_train_profile.py --shapes "8192,1024,4096" --out prof.json
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import torch._dynamo
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from ember.frontend.backend import register


def linear_bias_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b))


def wall_us(step, reps: int = 200) -> tuple[float, float]:
    """Microseconds per step back to back: until the host returns (no sync), and until the GPU is done."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        step()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return host / reps * 1e6, wall / reps * 1e6


def kernels(step, reps: int = 5) -> dict:
    for _ in range(3):
        step()
    host, wall = wall_us(step)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(reps):
            step()
        torch.cuda.synchronize()
    rows: dict = {}
    for e in prof.events():
        if e.device_type.name != "CUDA":
            continue
        r = rows.setdefault(e.name, {"us": 0.0, "calls": 0})
        r["us"] += e.device_time / reps if hasattr(e, "device_time") else e.cuda_time / reps
        r["calls"] += 1 / reps
    ops = {}
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key.startswith("aten::") and e.key in (
            "aten::mm",
            "aten::addmm",
            "aten::bmm",
            "aten::copy_",
            "aten::clone",
        ):
            ops[f"{e.key} {e.input_shapes}"] = {"calls": e.count / reps, "device_us": e.device_time_total / reps}
    total = sum(r["us"] for r in rows.values())
    return {
        "host_us": host,
        "wall_us": wall,
        "gpu_us": total,
        "kernels": dict(sorted(rows.items(), key=lambda kv: -kv[1]["us"])),
        "ops": ops,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="8192,1024,4096;8192,4096,4096")
    ap.add_argument("--out", default="linear_train_profile.json")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile 100 compiled steps")
    args = ap.parse_args()
    register()  # backend="ember" from a checkout on PYTHONPATH
    results = []
    for shape in args.shapes.split(";"):
        m, n, k = map(int, shape.split(","))
        dev = "cuda"
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k**0.5).requires_grad_()
        b = torch.randn(n, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(m, n, device=dev, dtype=torch.bfloat16)
        for name in ("eager", "ember", "inductor"):
            torch._dynamo.reset()
            fn = {"eager": linear_bias_gelu}.get(name) or torch.compile(
                linear_bias_gelu, backend={"ember": "ember", "inductor": "inductor"}[name]
            )

            def step(fn=fn, x=x, w=w, b=b, dy=dy):
                return torch.autograd.grad(fn(x, w, b), (x, w, b), dy)

            row = {"shape": [m, n, k], "compiler": name, **kernels(step)}
            results.append(row)
            print(
                f"{shape} {name}: {row['gpu_us']:.1f} us GPU, {row['wall_us']:.1f} us wall, {row['host_us']:.1f} us host per step"
            )
            for kname, r in list(row["kernels"].items())[:8]:
                print(f"    {r['us']:8.1f} us x{r['calls']:.0f}  {kname[:100]}")
            for op, r in row["ops"].items():
                print(f"    op {op[:110]}  x{r['calls']:.0f}")
            if args.cprofile and name != "eager":
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(100):
                    step()
                torch.cuda.synchronize()
                prof.disable()
                for order in ("tottime", "cumulative"):
                    text = io.StringIO()
                    pstats.Stats(prof, stream=text).sort_stats(order).print_stats(30)
                    print(text.getvalue()[-6000:])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
