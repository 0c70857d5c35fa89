"""Where ember's compile time goes: the first step of a bench workload, from empty caches, under cProfile.

Prints each compiled graph's stage times (`GraphReport.stage_seconds`: backend, import, cse, pad,
split, schedule, cache write, build, host; a cached schedule replaces import through cache write),
the first step's wall time (Dynamo, AOTAutograd, ember, the run itself), and the ember functions
with the most cumulative and own time. Writes the pstats file to --out.
ember's and Triton's caches point at a fresh temporary folder, so nothing is reused, unless
--cache names one (run twice with the same --cache for a cold then a warm compile). --no-cprofile
times without the profiler, which inflates Python-heavy stages about twofold.

    PYTHONPATH=. python scripts/compile_profile.py --workload resnet50 --mode train --out DIR
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import tempfile
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="resnet50")
    p.add_argument("--mode", default="train")
    p.add_argument("--scale", default="auto", help="auto: gpu on cuda, else cpu")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out", default=None)
    p.add_argument("--cache", default=None, help="cache folder to use (and keep); default: a fresh one")
    p.add_argument("--no-cprofile", action="store_true")
    args = p.parse_args()
    cache = args.cache or tempfile.mkdtemp(prefix="ember-compile-profile-")
    for var in ("EMBER_CACHE_DIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        os.environ[var] = os.path.join(cache, var.lower())

    import torch

    from ember.frontend.backend import ember_backend
    from ember.report import collecting
    from ember.tools.bench import measure
    from ember.tools.bench.workloads import WORKLOADS

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    scale = args.scale if args.scale != "auto" else ("gpu" if device.type == "cuda" else "cpu")
    built = WORKLOADS[args.workload].instance(scale, device, args.mode)
    train = args.mode == "train"
    inputs = measure.prepare_inputs(built.inputs, train)
    step = measure.Step(torch.compile(built.fn, backend=ember_backend), train, built.autocast, device)
    prof = cProfile.Profile()
    with collecting() as report:
        t = time.perf_counter()
        if not args.no_cprofile:
            prof.enable()
        step(*inputs)
        measure.sync(device)
        prof.disable()
        first = time.perf_counter() - t
    how = "unprofiled" if args.no_cprofile else "profiled"
    print(f"{args.workload} {args.mode} on {device}: first step {first:.2f} s ({how}; cache {cache})")
    for g in report.graphs:
        print(" ", g.summary())
    stages: dict[str, float] = {}
    for g in report.graphs:
        for name, s in g.stage_seconds.items():
            stages[name] = stages.get(name, 0.0) + s
    print("  ember stages, all graphs:", ", ".join(f"{n} {s:.2f} s" for n, s in stages.items()))
    print(f"  ember in all: {sum(g.compile_seconds for g in report.graphs):.2f} s")
    if args.no_cprofile:
        return
    for key in ("cumulative", "tottime"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats("ember/|triton/", args.top)
        print(out.getvalue())
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        prof.dump_stats(os.path.join(args.out, f"compile_{args.workload}_{args.mode}.prof"))


if __name__ == "__main__":
    main()
