"""Where a workload's time goes, ember against Inductor: the top GPU kernels and the host time.

For each named bench workload (ember/tools/bench/workloads.py, GPU sizes, inference), compiles it
with ember and with Inductor, runs a few warm calls under torch.profiler and records, per
compiler: wall time per call, GPU kernel time per call, kernel launches per call, and the
kernels that take the most GPU time (name, calls, total µs). A gap between wall and GPU time
is host overhead; a big kernel ember has and Inductor lacks is a missed fusion or a copy.

    python scripts/gpu_profile.py --workloads resnet50,hf_bert --out profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time

import torch
import torch._dynamo
from torch.profiler import ProfilerActivity, profile

from ember.frontend.backend import ember_backend
from ember.report import collecting
from ember.tools.bench.workloads import WORKLOADS


TRAIN = False  # --train: forward + backward of out.float().mean()
TOP = 25  # --top: kernels listed per compiler


def _run(fn, inputs, autocast):
    ctx = torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    if TRAIN:
        with ctx:
            out = fn(*inputs)
        out.float().mean().backward()
        return out
    with torch.no_grad(), ctx:
        return fn(*inputs)


def _profile(fn, inputs, autocast, calls: int = 5) -> dict:
    for _ in range(3):
        _run(fn, inputs, autocast)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        _run(fn, inputs, autocast)
    torch.cuda.synchronize()
    wall_us = (time.perf_counter() - t) / calls * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            _run(fn, inputs, autocast)
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name[:120], [0, 0.0])
            k[0] += 1
            k[1] += e.device_time
    total = sum(v[1] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:TOP]
    return {
        "wall_us_per_call": wall_us,
        "gpu_us_per_call": total / calls,
        "launches_per_call": sum(v[0] for v in kernels.values()) / calls,
        "top": [{"kernel": n, "calls_per_call": c / calls, "us_per_call": us / calls} for n, (c, us) in top],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="resnet50,hf_bert,hf_gpt2,tiny_mlp_b1")
    p.add_argument("--out", default="profile.json")
    p.add_argument("--train", action="store_true")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    global TRAIN, TOP
    TRAIN, TOP = args.train, args.top
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for name in args.workloads.split(","):
        w = WORKLOADS[name]
        built = w.instance("gpu", torch.device("cuda"), "train" if TRAIN else "inference")
        row = {}
        for compiler, backend in (("ember", ember_backend), ("inductor", "inductor")):
            torch._dynamo.reset()
            try:
                fn = torch.compile(built.fn, backend=backend)
                with collecting() as report:
                    row[compiler] = _profile(fn, built.inputs, built.autocast)
                if compiler == "ember":  # what each of ember's kernels computes, to read the list by
                    row[compiler]["kernels"] = [
                        {"graph": g.kind, "kernel": k.name, "ops": k.ops[:12], "bytes": k.bytes}
                        for g in report.graphs
                        for k in g.kernels
                    ]
            except Exception as e:  # noqa: BLE001 - one workload's failure is a result, not the end
                row[compiler] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            r = row[compiler]
            print(name, compiler, {k: round(v, 1) for k, v in r.items() if isinstance(v, float)}, flush=True)
        results[name] = row
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
