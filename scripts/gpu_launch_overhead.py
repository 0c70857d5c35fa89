"""Per-call host cost of a compiled graph on the GPU: how fast can a tiny graph be called?

For a small pointwise program (1 kernel) and a 4-kernel chain, times N back-to-back calls and
divides: with kernels this small the GPU waits on the host, so the time per call is the
Python and launch overhead (Dynamo guards, AOTAutograd's wrapper, the host program, the
launches). Compares eager, Inductor, ember with direct launch and ember through
`kernel[grid](...)`, and checks every variant against eager, including an input that is not
16-byte aligned (a view at offset 1: ember's direct launch must fall back to kernel[grid]).

    python scripts/gpu_launch_overhead.py --out results.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch._dynamo

from ember import config
from ember.frontend.backend import ember_backend


def one_kernel(x, y):
    return torch.relu(x * 2 + y).sigmoid()


def four_kernels(x, w):
    h = (x * 2 + 1).sum(-1, keepdim=True)  # reduction, then pointwise over its result
    h = torch.softmax(x / h, -1)
    return (h @ w).tanh() + 1  # an extern (mm) between kernels


def per_call_us(fn, args, calls=2000) -> float:
    for _ in range(20):
        fn(*args)
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="launch_overhead.json")
    args = p.parse_args()
    dev = "cuda"
    cases = {
        "one_kernel": (one_kernel, (torch.randn(64, 64, device=dev), torch.randn(64, 64, device=dev))),
        "four_kernels": (four_kernels, (torch.randn(64, 64, device=dev), torch.randn(64, 32, device=dev))),
    }
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    import triton

    results["triton"] = triton.__version__
    for name, (fn, inputs) in cases.items():
        ref = fn(*inputs)
        row = {"eager_us": per_call_us(fn, inputs)}
        torch._dynamo.reset()
        inductor = torch.compile(fn)
        row["inductor_us"] = per_call_us(inductor, inputs)
        for direct in (True, False):
            torch._dynamo.reset()
            with config.override(direct_launch=direct, strict=True):
                compiled = torch.compile(fn, backend=ember_backend)
                out = compiled(*inputs)
                torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
                # A misaligned input (offset of one float): must still be right.
                base = torch.randn(inputs[0].numel() + 1, device=dev)
                odd = base[1:].view(inputs[0].shape)
                torch.testing.assert_close(compiled(odd, *inputs[1:]), fn(odd, *inputs[1:]), rtol=1e-4, atol=1e-4)
                row[f"ember_{'direct' if direct else 'grid'}_us"] = per_call_us(compiled, inputs)
        results[name] = row
        print(name, {k: round(v, 1) for k, v in row.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
