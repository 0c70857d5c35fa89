"""GEMM on the GPU: ember's Triton GEMM template vs ATen (cuBLAS), correctness and TFLOP/s (issue 5).

For the lead to run on the GPU machine (CUDA, triton; ember from the checkout):

    PYTHONPATH=$PWD python scripts/gpu_gemm_check.py out.json
    PYTHONPATH=$PWD python scripts/gpu_gemm_check.py out.json --shapes 8192,4096,4096 --train --inductor

Program: linear_bias_gelu, y = gelu(x @ w.T + b, approximate="tanh"), x [M, K], w [N, K], b [N],
bf16 by default. Columns per shape:
  matmul          torch.mm(x, w.T) alone: the measured bf16 matmul rate the others are held against
  eager           the program op by op
  ember_aten      ember with gemm=aten: cuBLAS addmm extern + one fused epilogue kernel
  ember_template  ember with gemm=template and each candidate tile forced in turn (one row per tile)
  ember_auto      ember with gemm=auto: the measured choice (first compile measures, and the time that
                  took is reported; the timings land in the disk cache, so the second compile reads them)
  inductor        torch.compile default (with --inductor)
For each: median time (triton.testing.do_bench), TFLOP/s of the product (2*M*N*K / time), the largest
error against an fp32 reference computed from the same bf16 inputs (eager bf16's own error next to
it), the kernels/externs ember ran, and ember's GEMM decision. With --train also forward+backward
(the backward's two products go through the same choice).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch
import torch._dynamo
import torch.nn.functional as F
import triton.testing

import ember  # noqa: F401  (registers the backend)
import ember.backends.triton as triton_backend
from ember.backends import gemm_tuning
from ember.frontend.backend import ember_backend
from ember.report import collecting
from ember.schedule.gemm import GemmChoice, GemmProblem

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def linear_bias_gelu(x, w, b):
    return F.gelu(F.linear(x, w, b), approximate="tanh")


def _bench(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100) / 1e3  # seconds (median)


def _err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.float() - ref.float()).abs().max().item()


class forced_tile:
    """Force one template tile (monkeypatching the backend's chooser for the duration)."""

    def __init__(self, tile):
        self.tile = tile

    def __enter__(self):
        self.saved = triton_backend.choose_gemm
        tile = self.tile
        triton_backend.choose_gemm = lambda problem, _b, _d: GemmChoice(True, tile, f"forced tile {tile}")

    def __exit__(self, *exc):
        triton_backend.choose_gemm = self.saved


def _ember(options: dict):
    torch._dynamo.reset()
    return torch.compile(linear_bias_gelu, backend=ember_backend, options={"strict": True, **options})


def _step(fn, x, w, b, dy, train: bool):
    if not train:
        return lambda: fn(x, w, b)

    def run():
        y = fn(x, w, b)
        return torch.autograd.grad(y, (x, w, b), dy)

    return run


def run_one(name: str, fn, x, w, b, ref, eager_err, flops, train, dy) -> dict:
    row: dict = {"name": name}
    try:
        with collecting() as report:
            start = time.perf_counter()
            out = fn(x, w, b)
            if train:
                torch.autograd.grad(out, (x, w, b), dy)
            torch.cuda.synchronize()
            row["first_call_s"] = time.perf_counter() - start
        row["max_err"] = _err(out, ref)
        row["eager_err"] = eager_err
        row["ok"] = row["max_err"] <= 2 * eager_err + 2**-7 * max(1.0, ref.abs().max().item())
        t = _bench(_step(fn, x, w, b, dy, train))
        row["ms"] = t * 1e3
        row["tflops"] = flops * (3 if train else 1) / t / 1e12
        graphs = report.graphs
        if graphs:
            row["kernels"] = [len(g.kernels) for g in graphs]
            row["externs"] = [g.externs for g in graphs]
            row["fallback"] = [g.fallback for g in graphs if g.fallback]
            row["gemm"] = [f.reason for g in graphs for f in g.fusion if "GEMM" in f.producer or "ATen" in f.producer]
            row["epilogue"] = [f.reason for g in graphs for f in g.fusion if "epilogue fused" in f.reason]
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-4000:]
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return row


def check_shape(m: int, n: int, k: int, dtype, train: bool, inductor: bool) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(m, k, device=dev, dtype=dtype, generator=gen).requires_grad_(train)
    w = (torch.randn(n, k, device=dev, dtype=dtype, generator=gen) / k**0.5).requires_grad_(train)
    b = torch.randn(n, device=dev, dtype=dtype, generator=gen).requires_grad_(train)
    dy = torch.randn(m, n, device=dev, dtype=dtype, generator=gen) if train else None
    flops = 2 * m * n * k
    with torch.no_grad():
        ref = linear_bias_gelu(x.float(), w.float(), b.float())
        eager_out = linear_bias_gelu(x, w, b)
    eager_err = _err(eager_out, ref)
    result: dict = {"shape": [m, n, k], "dtype": str(dtype), "train": train, "rows": []}
    wt = w.detach().t()
    t_mm = _bench(lambda: torch.mm(x.detach(), wt))
    result["matmul_ms"], result["matmul_tflops"] = t_mm * 1e3, flops / t_mm / 1e12
    print(json.dumps({"shape": [m, n, k], "matmul_tflops": result["matmul_tflops"]}), flush=True)
    rows = result["rows"]
    rows.append(run_one("eager", linear_bias_gelu, x, w, b, ref, eager_err, flops, train, dy))
    rows.append(run_one("ember_aten", _ember({"gemm": "aten"}), x, w, b, ref, eager_err, flops, train, dy))
    problem = GemmProblem(1, m, n, k, dtype, "row", "col", str(dev))
    for tile in gemm_tuning.candidates(problem):
        with forced_tile(tile):
            fn = _ember({"gemm": "template"})
            rows.append(run_one(f"ember_template {tile}", fn, x, w, b, ref, eager_err, flops, train, dy))
    # auto: the first compile measures (or reads the disk cache), the second must not measure again.
    gemm_tuning._memo.clear()
    rows.append(run_one("ember_auto (first compile)", _ember({"gemm": "auto"}), x, w, b, ref, eager_err, flops,
                        train, dy))  # fmt: skip
    gemm_tuning._memo.clear()
    rows.append(run_one("ember_auto (from disk cache)", _ember({"gemm": "auto"}), x, w, b, ref, eager_err, flops,
                        train, dy))  # fmt: skip
    if inductor:
        torch._dynamo.reset()
        rows.append(run_one("inductor", torch.compile(linear_bias_gelu), x, w, b, ref, eager_err, flops, train, dy))
    timed = [r for r in rows if "ms" in r and r["name"].startswith("ember_template")]
    if timed:
        best = min(timed, key=lambda r: r["ms"])
        result["best_template"] = best["name"]
        result["best_template_fraction_of_matmul"] = best["tflops"] / result["matmul_tflops"]
    return result


# Forms the template must get right on the GPU (compiled, not interpreted): odd sizes, transposed
# operands, bmm, epilogues over a reshape, low precision. Forward and backward against eager.
FORMS = {
    "mm_odd": (torch.mm, [(33, 17), (17, 29)]),
    "linear_bias_gelu": (linear_bias_gelu, [(300, 200), (136, 200), (136,)]),
    "bmm_transposed_b": (lambda a, b: torch.relu(torch.bmm(a, b.transpose(1, 2))), [(3, 70, 64), (3, 90, 64)]),
    "transposed_a": (lambda x, w: torch.sigmoid(x.t() @ w), [(64, 96), (64, 130)]),
    "linear_3d_residual": (lambda x, w, b, r: F.linear(x, w, b) + r, [(4, 33, 64), (48, 64), (48,), (4, 33, 48)]),
    "residual_scale_cast": (lambda x, w, r: ((x @ w) * 0.5 + r).float(), [(128, 256), (256, 192), (128, 192)]),
}


def check_forms(dtype) -> list[dict]:
    rows = []
    for name, (fn, shapes) in FORMS.items():
        row: dict = {"form": name, "dtype": str(dtype)}
        try:
            gen = torch.Generator(device="cuda").manual_seed(1)
            base = [torch.randn(s, device="cuda", generator=gen) for s in shapes]
            ins = [t.to(dtype).requires_grad_(True) for t in base]
            refs = [t.detach().to(dtype).float().requires_grad_(True) for t in base]
            torch._dynamo.reset()
            with collecting() as report:
                compiled = torch.compile(fn, backend=ember_backend, options={"strict": True, "gemm": "template"})
                out = compiled(*ins)
                grads = torch.autograd.grad(out.float().sum(), ins)
            ref = fn(*refs)
            ref_grads = torch.autograd.grad(ref.float().sum(), refs)
            eager = fn(*[t.detach().requires_grad_(True) for t in ins])
            scale = max(1.0, ref.abs().max().item())
            row["out_err"], row["eager_out_err"] = _err(out, ref), _err(eager, ref)
            row["grad_err"] = max(_err(g, r) / max(1.0, r.abs().max().item()) for g, r in zip(grads, ref_grads))
            tol = 1e-4 if dtype == torch.float32 else 2**-6
            row["ok"] = row["out_err"] <= 2 * row["eager_out_err"] + tol * scale and row["grad_err"] <= tol * 4
            row["externs"] = [g.externs for g in report.graphs]
        except Exception as e:
            row["ok"], row["error"] = False, f"{type(e).__name__}: {e}"[:2000]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="where to write the JSON results")
    p.add_argument("--shapes", default="8192,4096,4096;8192,1024,4096;2048,2048,2048", help="M,N,K;M,N,K;...")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--train", action="store_true", help="also time forward+backward")
    p.add_argument("--inductor", action="store_true", help="also time torch.compile's default (Inductor)")
    args = p.parse_args()
    assert torch.cuda.is_available(), "this script checks the GEMM template on a GPU"
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "shapes": [],
    }
    results["forms"] = [r for dt in (torch.float32, DTYPES[args.dtype]) for r in check_forms(dt)]
    for spec in args.shapes.split(";"):
        m, n, k = (int(s) for s in spec.split(","))
        for train in [False] + ([True] if args.train else []):
            results["shapes"].append(check_shape(m, n, k, DTYPES[args.dtype], train, args.inductor))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
