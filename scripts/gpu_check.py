"""Foundation check on the GPU machine: correctness vs eager and a first timing look.

Kept as the script behind docs/gpu_foundation.md. For measurements, use `ember bench`
(ember/tools/bench): one instrument with ceilings, peak memory and cold/warm compile times.

For each workload, dtype (float32, bfloat16) and mode (inference; training = forward +
backward): ember's outputs and gradients against eager, kernel counts and fallbacks from
ember's reports, and median times (triton.testing.do_bench) for eager, ember and Inductor,
plus each compiler's compile time (first call). Writes results.json and results.md to $OUT
(or ./gpu_check_out). Not the benchmark harness (that is its own issue): a first look.

    python scripts/gpu_check.py [--workloads a,b] [--dtypes float32,bfloat16] [--no-inductor]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
import traceback

import torch
import torch._dynamo
import triton
import triton.testing

import ember  # noqa: F401
from ember.report import collecting
from ember.tools.workloads import WORKLOADS


def tensors(x):
    return [t for t in (x if isinstance(x, (tuple, list)) else [x]) if isinstance(t, torch.Tensor)]


def params_of(fn):
    return [p for p in fn.parameters()] if isinstance(fn, torch.nn.Module) else []


def step(fn, inputs, train: bool):
    """One inference call, or a forward + backward; returns outputs (and grads)."""
    if not train:
        with torch.no_grad():
            return tensors(fn(*inputs))
    leaves = [x for x in inputs if x.requires_grad] + params_of(fn)
    outs = tensors(fn(*inputs))
    # Random (seeded) output gradients: with ones, a final LayerNorm of unit weight passes
    # exactly zero gradient upstream and every comparison measures rounding noise.
    gen = torch.Generator(device=outs[0].device).manual_seed(1)
    cotangents = [torch.randn(o.shape, generator=gen, device=o.device, dtype=o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, leaves, cotangents, allow_unused=True)
    return outs + [g for g in grads if g is not None]


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(fn) -> float:
    """Median ms: device events on the GPU; a synchronizing wall clock on a CPU dry run."""
    if torch.cuda.is_available():
        return triton.testing.do_bench(fn, return_mode="median")
    from ember.tools.demo import median_ms

    return median_ms(fn, "cpu", 5)


def run_one(name, dtype, train, use_inductor, scale="gpu", device="cuda", profile=False):
    torch.manual_seed(0)
    fn, inputs = WORKLOADS[name].make(scale, dtype, device)
    if train:
        inputs = tuple(x.detach().requires_grad_(x.is_floating_point()) for x in inputs)
    # fp32 reference from the same weights and inputs
    ref_fn = copy.deepcopy(fn).float() if isinstance(fn, torch.nn.Module) else fn
    ref_inputs = tuple(x.detach().float().requires_grad_(x.requires_grad) for x in inputs)
    ref = step(ref_fn, ref_inputs, train)
    eager = step(fn, inputs, train)
    row = {"workload": name, "dtype": str(dtype).replace("torch.", ""), "mode": "train" if train else "inference"}

    torch._dynamo.reset()
    ember_fn = torch.compile(fn, backend="ember")  # through the entry point, as users call it
    with collecting() as report:
        t0 = time.perf_counter()
        out = step(ember_fn, inputs, train)
        sync()
        row["ember_compile_s"] = time.perf_counter() - t0
    row["ember_kernels"] = {g.kind: len(g.kernels) for g in report.graphs}
    row["ember_externs"] = {g.kind: len(g.externs) for g in report.graphs}
    row["fallbacks"] = [g.fallback for g in report.graphs if g.fallback]
    row["ember_compile_graph_s"] = sum(g.compile_seconds for g in report.graphs)
    eager_err = max(rel_err(e, r) for e, r in zip(eager, ref))
    ember_err = max(rel_err(o, r) for o, r in zip(out, ref))
    row["eager_err_vs_fp32"], row["ember_err_vs_fp32"] = eager_err, ember_err
    # ember must be no worse than eager's own error vs the fp32 reference, within rounding slack
    slack = 1e-5 if dtype == torch.float32 else 2e-2
    row["correct"] = bool(ember_err <= 2 * eager_err + slack and not row["fallbacks"])

    row["eager_ms"] = bench(lambda: step(fn, inputs, train))
    row["ember_ms"] = bench(lambda: step(ember_fn, inputs, train))
    if use_inductor:
        torch._dynamo.reset()
        ind_fn = torch.compile(fn)
        t0 = time.perf_counter()
        ind_out = step(ind_fn, inputs, train)
        sync()
        row["inductor_compile_s"] = time.perf_counter() - t0
        row["inductor_err_vs_fp32"] = max(rel_err(o, r) for o, r in zip(ind_out, ref))
        row["inductor_ms"] = bench(lambda: step(ind_fn, inputs, train))
    if profile:
        row["profile"] = {"ember": top_kernels(lambda: step(ember_fn, inputs, train))}
        if use_inductor:
            row["profile"]["inductor"] = top_kernels(lambda: step(ind_fn, inputs, train))
    torch._dynamo.reset()
    return row


def top_kernels(fn, n=12):
    """The n GPU kernels taking the most time over 5 calls (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=n)
    print(table)
    return table


def markdown(rows, header):
    cols = [
        ("workload", "{}"),
        ("dtype", "{}"),
        ("mode", "{}"),
        ("correct", "{}"),
        ("ember_err_vs_fp32", "{:.1e}"),
        ("eager_err_vs_fp32", "{:.1e}"),
        ("eager_ms", "{:.3f}"),
        ("ember_ms", "{:.3f}"),
        ("inductor_ms", "{:.3f}"),
        ("ember_compile_s", "{:.2f}"),
        ("inductor_compile_s", "{:.2f}"),
        ("ember_kernels", "{}"),
    ]
    lines = [header, "", "| " + " | ".join(c for c, _ in cols) + " | ember/inductor |", "|" + "---|" * (len(cols) + 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['workload']} | {r['dtype']} | {r['mode']} | ERROR: {r['error'][:120]} |")
            continue
        cells = [fmt.format(r[c]) if c in r else "-" for c, fmt in cols]
        ratio = f"{r['inductor_ms'] / r['ember_ms']:.2f}x" if "inductor_ms" in r else "-"
        lines.append("| " + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="pointwise3,gelu_tanh,softmax,layernorm_gelu,mlp,gpt2_block")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--no-inductor", action="store_true")
    p.add_argument("--train", default="mlp,gpt2_block,layernorm_gelu")
    p.add_argument("--scale", default="gpu", help="small: a CPU dry run of this script")
    p.add_argument("--profile", action="store_true", help="print each compiler's top GPU kernels")
    args = p.parse_args()
    out_dir = os.environ.get("OUT", "gpu_check_out")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for name in args.workloads.split(","):
        for dt in args.dtypes.split(","):
            for train in (False, True):
                if train and name not in args.train.split(","):
                    continue
                try:
                    row = run_one(
                        name,
                        getattr(torch, dt),
                        train,
                        not args.no_inductor,
                        args.scale,
                        "cuda" if torch.cuda.is_available() else "cpu",
                        args.profile,
                    )
                except Exception as e:  # noqa: BLE001
                    row = {
                        "workload": name,
                        "dtype": dt,
                        "mode": "train" if train else "inference",
                        "error": f"{type(e).__name__}: {e}",
                        "trace": traceback.format_exc(),
                    }
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("trace", "profile")}), flush=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU dry run)"
    header = f"GPU: {gpu}, torch {torch.__version__}, triton {triton.__version__}, date {time.strftime('%Y-%m-%d')}"
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"header": header, "rows": rows}, f, indent=1)
    md = markdown(rows, header)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
