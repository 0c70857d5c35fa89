"""On the GPU: how column sums (bias gradients) are split and tiled, swept in a whole model.

    PYTHONPATH=. python scripts/gpu_column_sum_sweep.py [--workload gpt2_blocks] [--out f.jsonl]

Column sums measure differently alone and in a model (the input was just written, partly in
L2; session 7's isolated sweep did not predict the model), so each setting compiles the whole
training step of a bench workload and records the GPU time per step (torch.profiler) and the
time of each kernel that reduces across rows. Settings: `split.TARGET_PARTIALS` (how many
partial results the first stage of a split sum aims for) and the launch config of column sums
with one tile input (XBLOCK columns, RBLOCK rows a step, warps, loop stages), set by wrapping
`codegen.triton.launch_config`. Inductor's time for the same step is the first row.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os

import torch
from torch.profiler import ProfilerActivity, profile

os.environ["EMBER_CACHE"] = "0"  # every setting compiles afresh

import ember.codegen.triton as triton_codegen
from ember.frontend.backend import ember_backend
from ember.schedule import split
from ember.tools.bench.workloads import WORKLOADS

_ORIGINAL = triton_codegen.launch_config
_LAUNCH: dict = {}
_COLUMN_KERNELS: set = set()  # names of the last compile's column-sum kernels


def _launch_config(kernel):
    launch = _ORIGINAL(kernel)
    tiles = triton_codegen._tile_loads(kernel)
    if not kernel.column_partials and len(tiles) == 1 and triton_codegen._reduces_across_rows(tiles):
        _COLUMN_KERNELS.add(kernel.name)
        if _LAUNCH:
            launch = dataclasses.replace(
                launch,
                xblock=_LAUNCH["xblock"],
                rblock=_LAUNCH["rblock"],
                num_warps=_LAUNCH["warps"],
                loop_stages=_LAUNCH["stages"],
            )
    return launch


triton_codegen.launch_config = _launch_config


def _step(fn, inputs, autocast):
    ctx = torch.autocast("cuda", dtype=autocast) if autocast is not None else contextlib.nullcontext()
    with ctx:
        out = fn(*inputs)
    out.float().mean().backward()


def _measure(fn, inputs, autocast, calls: int = 5) -> dict:
    for _ in range(3):
        _step(fn, inputs, autocast)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            _step(fn, inputs, autocast)
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] = per_kernel.get(e.name, 0.0) + e.device_time / calls
    return {"gpu_us": sum(per_kernel.values()), "kernels": per_kernel}


SETTINGS = [
    {"partials": 32768},  # the product's own
    {"partials": 65536},
    {"partials": 131072},
    {"partials": 262144},
    {"partials": 131072, "xblock": 64, "rblock": 64, "warps": 4, "stages": 0},
    {"partials": 131072, "xblock": 32, "rblock": 128, "warps": 4, "stages": 0},
    {"partials": 131072, "xblock": 64, "rblock": 128, "warps": 8, "stages": 2},
    {"partials": 65536, "xblock": 128, "rblock": 32, "warps": 4, "stages": 0},
    # Inductor's "outer" reduction config (64 columns by 8 rows a step, 4 warps) and around it
    {"partials": 131072, "xblock": 64, "rblock": 8, "warps": 4, "stages": 0},
    {"partials": 262144, "xblock": 64, "rblock": 8, "warps": 4, "stages": 0},
    {"partials": 131072, "xblock": 64, "rblock": 16, "warps": 4, "stages": 0},
    {"partials": 131072, "xblock": 64, "rblock": 8, "warps": 2, "stages": 0},
    {"partials": 131072, "xblock": 128, "rblock": 8, "warps": 4, "stages": 0},
    {"partials": 131072, "xblock": 64, "rblock": 8, "warps": 4, "stages": 2},
    {"partials": 32768, "xblock": 64, "rblock": 8, "warps": 4, "stages": 0},
]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workload", default="gpt2_blocks")
    p.add_argument("--out", default="column_sum_sweep.jsonl")
    p.add_argument("--settings", default="", help="comma-separated indices into SETTINGS (default: all)")
    args = p.parse_args()
    built = WORKLOADS[args.workload].instance("gpu", torch.device("cuda"), "train")
    chosen = [SETTINGS[int(i)] for i in args.settings.split(",")] if args.settings else SETTINGS
    with open(args.out, "w") as out:

        def record(row):
            print(json.dumps({k: v for k, v in row.items() if k != "kernels"}), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()

        torch._dynamo.reset()
        fn = torch.compile(built.fn)
        record({"compiler": "inductor", **_measure(fn, built.inputs, built.autocast)})
        for setting in chosen:
            torch._dynamo.reset()
            split.TARGET_PARTIALS = setting["partials"]
            _LAUNCH.clear()
            _LAUNCH.update({k: v for k, v in setting.items() if k != "partials"})
            _COLUMN_KERNELS.clear()
            fn = torch.compile(built.fn, backend=ember_backend)
            row = {"compiler": "ember", "setting": setting, **_measure(fn, built.inputs, built.autocast)}
            # By name: a forward kernel of the same name (k56 in both graphs) counts too.
            row["column_us"] = sum(us for name, us in row["kernels"].items() if name in _COLUMN_KERNELS)
            row["column_kernels"] = sorted(_COLUMN_KERNELS)
            record(row)


if __name__ == "__main__":
    main()
