"""Where the host's time goes in a compiled training or inference step: cProfile over warm calls.

A step whose wall time is well above its GPU time is bound by the host (Python, launches, ATen
dispatch). This runs a bench workload compiled by ember (or Inductor) for a few warm steps and
prints, unprofiled: the wall time per step, the host's time per step (until the step returns;
the GPU may still be running) and, for ember, the time spent inside its compiled graphs' host
programs (the rest is Dynamo, AOTAutograd, autograd and the caller). Then cProfile over the same
steps: the functions with the most own and cumulative time (cProfile inflates small calls).

    PYTHONPATH=. python scripts/gpu_host_profile.py --workload resnet50 --mode train [--compiler inductor]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from ember.frontend.backend import ember_backend
from ember.pipeline import CompiledGraph
from ember.tools.bench import measure
from ember.tools.bench.workloads import WORKLOADS


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="resnet50")
    p.add_argument("--mode", default="train")
    p.add_argument("--compiler", default="ember")
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda")
    w = WORKLOADS[args.workload]
    built = w.instance("gpu", device, args.mode)
    train = args.mode == "train"
    inputs = measure.prepare_inputs(built.inputs, train)
    in_programs = [0.0]
    original_call = CompiledGraph.__call__

    def timed_call(self, graph_args):
        t0 = time.perf_counter()
        try:
            return original_call(self, graph_args)
        finally:
            in_programs[0] += time.perf_counter() - t0

    CompiledGraph.__call__ = timed_call
    backend = ember_backend if args.compiler == "ember" else "inductor"
    step = measure.Step(torch.compile(built.fn, backend=backend), train, built.autocast, device)
    for _ in range(3):
        step(*inputs)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(args.steps):
        step(*inputs)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / args.steps
    host = 0.0
    in_programs[0] = 0.0
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step(*inputs)
        host += time.perf_counter() - t
    torch.cuda.synchronize()
    host /= args.steps
    programs = in_programs[0] / args.steps
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step(*inputs)
    torch.cuda.synchronize()
    prof.disable()
    print(
        f"{args.workload} {args.mode} {args.compiler}: {wall * 1e3:.2f} ms wall per step, {host * 1e3:.2f} ms host "
        f"until the step returns, {programs * 1e3:.2f} ms of it in ember's host programs (unprofiled)"
    )
    for key in ("tottime", "cumtime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
