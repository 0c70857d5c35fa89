"""On the GPU: launch configs of the row kernels that also sum their rows' columns, swept.

    PYTHONPATH=. python scripts/gpu_column_partials_sweep.py [--out sweep.jsonl] [--cases a,b]

For each case of `gpu_column_partials_check.py` (a LayerNorm or RMSNorm forward + backward
step) and each (row-kernel programs, XBLOCK rows a step, warps, loop stages): the device time
per step (torch.profiler, every kernel) and the check against the fp32 reference. Inductor's
time for the same step is the first row of each case. The launch config of the kernels with
column partials is overridden by wrapping `codegen.triton.launch_config`; the chunking (rows
per program) comes from `EMBER_COLUMN_PARTIAL_PROGRAMS`, as in the product.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ["EMBER_CACHE"] = "0"  # every config compiles afresh

from gpu_column_partials_check import _cases, _max_err, _step, device_us

import ember.codegen.triton as triton_codegen
from ember.frontend.backend import ember_backend

_ORIGINAL = triton_codegen.launch_config
_OVERRIDE: dict = {}
_SEEN: list = []  # the launch configs of the last compile's kernels with column partials


def _launch_config(kernel):
    launch = _ORIGINAL(kernel)
    if kernel.column_partials and _OVERRIDE:
        if launch.rows_per_program % _OVERRIDE["xblock"]:
            raise ValueError("XBLOCK does not divide the chunk")
        launch = dataclasses.replace(
            launch, xblock=_OVERRIDE["xblock"], num_warps=_OVERRIDE["warps"], loop_stages=_OVERRIDE["stages"]
        )
    if kernel.column_partials:
        _SEEN.append(dataclasses.asdict(launch))
    return launch


triton_codegen.launch_config = _launch_config


def _configs(programs: list[int]):
    yield None  # the product's own choice
    for p, (xblock, warps), stages in itertools.product(
        programs, [(1, 2), (1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8)], (0, 3)
    ):
        yield {"programs": p, "xblock": xblock, "warps": warps, "stages": stages}


def _sweep_case(name, make, shape, dtype, programs, out) -> None:
    dev = torch.device("cuda")
    torch.manual_seed(0)
    base = make().to(dev)
    with torch.no_grad():
        for prm in base.parameters():
            prm.normal_(1.0, 0.1)
    x0, g0 = torch.randn(shape, device=dev), torch.randn(shape, device=dev)
    ref = _step(base.float(), x0.clone().requires_grad_(), g0)
    model = make().to(dev, dtype)
    model.load_state_dict(base.state_dict())
    x, g = x0.to(dtype).requires_grad_(), g0.to(dtype)
    eager_err = [_max_err(a, r) for a, r in zip(_step(model, x, g), ref)]

    def record(row):
        print(json.dumps(row), flush=True)
        out.write(json.dumps(row) + "\n")
        out.flush()

    torch._dynamo.reset()
    compiled = torch.compile(model)
    _step(compiled, x, g)
    record({"case": name, "compiler": "inductor", "us": device_us(lambda: _step(compiled, x, g))})
    for cfg in _configs(programs):
        torch._dynamo.reset()
        _OVERRIDE.clear()
        _SEEN.clear()
        row = {"case": name, "compiler": "ember", "config": cfg or "default"}
        os.environ["EMBER_COLUMN_PARTIAL_PROGRAMS"] = str(cfg["programs"] if cfg else 0)
        _OVERRIDE.update(cfg or {})
        try:
            ember_step = torch.compile(model, backend=ember_backend)
            got = _step(ember_step, x, g)
            row["us"] = device_us(lambda: _step(ember_step, x, g))  # noqa: B023 - called at once
            err = [_max_err(a, r) for a, r in zip(got, ref)]
            row["ok"] = all(
                e <= 2 * ee + 2**-8 * max(1.0, r.abs().max().item()) for e, ee, r in zip(err, eager_err, ref)
            )
            row["launch"] = list(_SEEN)
        except Exception as e:  # noqa: BLE001 - a failing config is a result to record
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        record(row)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="column_partials_sweep.jsonl")
    p.add_argument("--cases", default="layernorm_bf16_16384x768,rmsnorm_bf16_8192x4096")
    p.add_argument("--programs", default="132,264,528")
    args = p.parse_args()
    cases = _cases()
    with open(args.out, "w") as out:
        for name in args.cases.split(","):
            _sweep_case(name, *cases[name], [int(n) for n in args.programs.split(",")], out)


if __name__ == "__main__":
    main()
