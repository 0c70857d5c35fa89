"""Dump ember's view of bench workloads on the GPU: every graph's kernels (ops, domain, bytes,
estimate), externs, fusion decisions (incl. GEMM template choices), host program and kernel
source, plus per-kernel measured time from torch.profiler, into one text file per workload.

    python scripts/gpu_explain.py --workloads resnet50,hf_gpt2 --out DIR [--gemm aten] [--train]

--train: a training step (forward and backward, the bench's Step), so the backward graph too.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

from ember import config
from ember.frontend.backend import ember_backend
from ember.report import collecting
from ember.tools.bench import measure
from ember.tools.bench.workloads import WORKLOADS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="resnet50,hf_gpt2")
    p.add_argument("--out", default="explain")
    p.add_argument("--gemm", default=None)
    p.add_argument("--train", action="store_true")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    overrides = {"gemm": args.gemm} if args.gemm else {}
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        dev = torch.device("cuda")
        mode = "train" if args.train else "inference"
        built = w.instance("gpu", dev, mode)
        inputs = measure.prepare_inputs(built.inputs, args.train)
        torch._dynamo.reset()
        with config.override(**overrides):
            step = measure.Step(torch.compile(built.fn, backend=ember_backend), args.train, built.autocast, dev)
            with collecting() as report:
                step(*inputs)
            for _ in range(3):
                step(*inputs)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                step(*inputs)
                torch.cuda.synchronize()
        times: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times[e.name] = times.get(e.name, 0.0) + e.device_time
        with open(os.path.join(args.out, f"{name}.txt"), "w") as f:
            for g in report.graphs:
                f.write(str(g) + "\n")
                f.writelines(f"  measured {k.name}: {times.get(k.name, 0.0):.1f} us\n" for k in g.kernels)
                f.write("  fusion decisions:\n")
                f.writelines(f"    {d}\n" for d in g.fusion)
                f.write("\n--- host program ---\n" + g.host_source + "\n")
                f.writelines(
                    f"\n--- {k.name} ({times.get(k.name, 0.0):.1f} us) ---\n{k.source}\n"
                    for k in sorted(g.kernels, key=lambda k: -times.get(k.name, 0.0))[:8]
                )
            f.write("\n--- all GPU kernels by time ---\n")
            f.writelines(f"{t:10.1f} us  {n[:160]}\n" for n, t in sorted(times.items(), key=lambda kv: -kv[1])[:60])
        print(name, "done", flush=True)


if __name__ == "__main__":
    main()
