"""Launch shapes of looped (non-persistent) reductions on the GPU: cross_entropy over a 50257-wide
vocabulary with each (RBLOCK, num_warps), against Inductor, to pick codegen/triton.py's default.

    python scripts/gpu_looped_reduction_sweep.py --out sweep.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch._dynamo
import torch.nn.functional as F
import triton.testing

import ember.codegen.triton as codegen
from ember.frontend.backend import ember_backend

VARIANTS = [(2048, 8), (1024, 4), (1024, 8), (2048, 4), (2048, 16), (4096, 8), (4096, 16), (8192, 16)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="sweep.json")
    args = p.parse_args()
    x = torch.randn(8192, 50257, device="cuda", dtype=torch.bfloat16)
    t = torch.randint(0, 50257, (8192,), device="cuda")
    fn = lambda x, t: F.cross_entropy(x, t)  # noqa: E731
    ref = fn(x.float(), t)
    original = codegen.launch_config
    results = {"device": torch.cuda.get_device_name()}
    torch._dynamo.reset()
    results["inductor_ms"] = triton.testing.do_bench(lambda: torch.compile(fn)(x, t))
    for rblock, warps in VARIANTS:

        def patched(kernel, rblock=rblock, warps=warps):
            cfg = original(kernel)
            if cfg.rblock and not cfg.persistent and cfg.xblock == 1:
                return codegen.LaunchConfig(1, rblock, warps, False)
            return cfg

        codegen.launch_config = patched
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend=ember_backend)
        err = (compiled(x, t).float() - ref).abs().item()
        ms = triton.testing.do_bench(lambda: compiled(x, t))
        results[f"rblock{rblock}_warps{warps}"] = {"ms": ms, "abs_err": err}
        print(rblock, warps, round(ms, 4), err, flush=True)
    codegen.launch_config = original
    print("inductor", results["inductor_ms"])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
