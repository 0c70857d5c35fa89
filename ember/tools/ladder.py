"""`ember ladder`: the abstraction ladder, measured on this machine.

Two operations, each climbed rung by rung:
- matmul, C = A @ B (n x n, fp32): 2n^3 FLOPs, against the device's measured matmul rate;
- layer norm + GELU, y = gelu(layer_norm(x) * w + b) (rows x cols, fp32): bytes read and written,
  against the device's measured copy bandwidth.

Rungs: pure Python loops (on a smaller size: they are slow) -> NumPy (BLAS; vectorized array code) ->
eager PyTorch -> ember (torch.compile(backend="ember")); on a GPU also eager PyTorch on the GPU (cuBLAS) ->
ember on the GPU (its products are cuBLAS calls by default; also under gemm=template, its Triton template) ->
a hand-written Triton kernel (ladder_triton.py). Each rung's result is checked
against float64 before it is timed; a wrong rung is reported, not timed. Per rung: size, ms, GFLOP/s or
GB/s and percent of the measured peak, as a table, JSON and a matplotlib plot.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ember import config

EPS = 1e-5
# (matmul n, matmul n for Python loops, LN rows, LN cols, LN rows for Python loops) per size.
SIZES = {
    "small": (64, 24, 64, 256, 4),
    "cpu": (512, 64, 4096, 1024, 16),
    "gpu": (4096, 64, 16384, 4096, 16),
}


@dataclass
class Rung:
    op: str  # "matmul" | "layernorm_gelu"
    rung: str
    device: str
    size: str
    ms: float | None = None
    rate: float | None = None  # GFLOP/s (matmul) or GB/s (layer norm + GELU)
    unit: str = ""
    percent_of_peak: float | None = None
    error: str = ""


# -- the rungs' programs -----------------------------------------------------------------------------


def matmul_python(a: list, b: list) -> list:
    n, k, m = len(a), len(b), len(b[0])
    out = [[0.0] * m for _ in range(n)]
    for i in range(n):
        row, ai = out[i], a[i]
        for p in range(k):
            aip, bp = ai[p], b[p]
            for j in range(m):
                row[j] += aip * bp[j]
    return out


def layernorm_gelu_python(x: list, w: list, b: list) -> list:
    out = []
    for row in x:
        n = len(row)
        mean = sum(row) / n
        var = sum((v - mean) ** 2 for v in row) / n
        inv = 1.0 / math.sqrt(var + EPS)
        y = []
        for v, wi, bi in zip(row, w, b):
            t = (v - mean) * inv * wi + bi
            y.append(0.5 * t * (1.0 + math.erf(t / math.sqrt(2.0))))
        out.append(y)
    return out


def layernorm_gelu_numpy(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    t = (x - mean) / np.sqrt(var + EPS) * w + b
    return 0.5 * t * (1.0 + _np_erf(t / np.sqrt(2.0)))


def _np_erf(z: np.ndarray) -> np.ndarray:
    """erf in array code (NumPy has none; np.vectorize of math.erf would be a Python loop): Abramowitz and
    Stegun's 7.1.26, absolute error below 1.5e-7, as fp32 code would compute it."""
    a = np.abs(z)
    t = 1.0 / (1.0 + 0.3275911 * a)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    return np.sign(z) * (1.0 - poly * np.exp(-a * a))


def layernorm_gelu_torch(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, x.shape[-1:], w, b, EPS))


# -- measuring -------------------------------------------------------------------------------------


def _time_ms(fn: Callable[[], object], device: torch.device, budget_s: float) -> float:
    """The median ms of fn over about `budget_s` (at least 3 calls), the device waited for."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 200):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times))


def _check(out, ref: torch.Tensor, what: str) -> None:
    got = torch.as_tensor(np.asarray(out, dtype=np.float64)) if not isinstance(out, torch.Tensor) else out
    got = got.detach().double().cpu()
    tol = 1e-3 * max(1.0, float(ref.abs().max()))
    err = float((got - ref).abs().max())
    if not err <= tol:
        raise AssertionError(f"{what}: max error {err:.3g} against float64 (tolerance {tol:.3g})")


def _rung(op, name, device, size, fn, ref, flops_or_bytes, peak, budget_s) -> Rung:
    unit = "GFLOP/s" if op == "matmul" else "GB/s"
    r = Rung(op, name, str(device), size, unit=unit)
    try:
        _check(fn(), ref, f"{op} {name}")
        r.ms = _time_ms(fn, device, budget_s)
    except Exception as e:  # noqa: BLE001 - a rung that fails is a row that says why
        r.error = f"{type(e).__name__}: {str(e)[:200]}"
        return r
    r.rate = flops_or_bytes / (r.ms / 1000) / 1e9
    r.percent_of_peak = 100 * r.rate * 1e9 / peak
    return r


def _ember(fn: Callable) -> Callable:
    from ember.frontend.backend import ember_backend

    return torch.compile(fn, backend=ember_backend, dynamic=False)


def climb(size: str = "cpu", budget_s: float = 0.5, gpu: bool | None = None) -> tuple[list[Rung], dict]:
    """Every rung of both operations; and the measured peaks (per device) they are put against."""
    from ember.tools.bench import measure

    gpu = torch.cuda.is_available() if gpu is None else gpu
    n, n_py, rows, cols, rows_py = SIZES["small" if size == "small" else "cpu"]
    peaks = {
        "cpu": measure.measure_ceilings(torch.device("cpu"), [torch.float32], "tiny" if size == "small" else "cpu")
    }
    rungs: list[Rung] = []
    g = torch.Generator().manual_seed(0)
    cpu = torch.device("cpu")
    mm_peak, bw_peak = peaks["cpu"]["flops"]["float32"], peaks["cpu"]["bandwidth_Bps"]

    # matmul
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    ref = a.double() @ b.double()
    a_py, b_py = a[:n_py, :n_py].tolist(), b[:n_py, :n_py].tolist()
    ref_py = a[:n_py, :n_py].double() @ b[:n_py, :n_py].double()
    rungs.append(
        _rung("matmul", "Python loops", cpu, f"{n_py}^3", lambda: matmul_python(a_py, b_py), ref_py,
              2 * n_py**3, mm_peak, budget_s)
    )  # fmt: skip
    an, bn = a.numpy(), b.numpy()
    rungs.append(_rung("matmul", "NumPy (BLAS)", cpu, f"{n}^3", lambda: an @ bn, ref, 2 * n**3, mm_peak, budget_s))
    rungs.append(_rung("matmul", "eager PyTorch", cpu, f"{n}^3", lambda: a @ b, ref, 2 * n**3, mm_peak, budget_s))
    mm = _ember(lambda x, y: x @ y)
    rungs.append(_rung("matmul", "ember", cpu, f"{n}^3", lambda: mm(a, b), ref, 2 * n**3, mm_peak, budget_s))

    # layer norm + GELU
    x, w, bias = torch.randn(rows, cols, generator=g), torch.randn(cols, generator=g), torch.randn(cols, generator=g)
    ref = layernorm_gelu_torch(x.double(), w.double(), bias.double())
    moved = (2 * rows * cols + 2 * cols) * 4
    x_py, w_py, b_py = x[:rows_py].tolist(), w.tolist(), bias.tolist()
    ref_py = ref[:rows_py]
    rungs.append(
        _rung("layernorm_gelu", "Python loops", cpu, f"{rows_py}x{cols}", lambda: layernorm_gelu_python(x_py, w_py, b_py),
              ref_py, (2 * rows_py * cols + 2 * cols) * 4, bw_peak, budget_s)
    )  # fmt: skip
    xn, wn, bn_ = x.numpy(), w.numpy(), bias.numpy()
    rungs.append(
        _rung("layernorm_gelu", "NumPy", cpu, f"{rows}x{cols}", lambda: layernorm_gelu_numpy(xn, wn, bn_), ref,
              moved, bw_peak, budget_s)
    )  # fmt: skip
    rungs.append(
        _rung("layernorm_gelu", "eager PyTorch", cpu, f"{rows}x{cols}", lambda: layernorm_gelu_torch(x, w, bias), ref,
              moved, bw_peak, budget_s)
    )  # fmt: skip
    ln = _ember(layernorm_gelu_torch)
    rungs.append(
        _rung("layernorm_gelu", "ember", cpu, f"{rows}x{cols}", lambda: ln(x, w, bias), ref, moved, bw_peak, budget_s)
    )
    if gpu:
        rungs += _gpu_rungs(size, budget_s, peaks)
    return rungs, peaks


def _gpu_rungs(size: str, budget_s: float, peaks: dict) -> list[Rung]:
    from ember.tools import ladder_triton
    from ember.tools.bench import measure

    dev = torch.device("cuda")
    n, _, rows, cols, _ = SIZES["small" if size == "small" else "gpu"]
    peaks["cuda"] = measure.measure_ceilings(dev, [torch.float32], "tiny" if size == "small" else "gpu")
    mm_peak, bw_peak = peaks["cuda"]["flops"]["float32"], peaks["cuda"]["bandwidth_Bps"]
    g = torch.Generator(device=dev).manual_seed(0)
    a, b = torch.randn(n, n, device=dev, generator=g), torch.randn(n, n, device=dev, generator=g)
    ref = (a.double() @ b.double()).cpu()
    out = []
    # TF32 off: every rung does the fp32 arithmetic it claims (the hand-written kernel too).
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        mm = _ember(lambda x, y: x @ y)  # ember's products are cuBLAS's by default (setting gemm)
        for name, fn in [
            ("eager PyTorch (cuBLAS)", lambda: a @ b),
            ("ember", lambda: mm(a, b)),
            ("hand-written Triton", lambda: ladder_triton.matmul(a, b)),
        ]:
            out.append(_rung("matmul", name, dev, f"{n}^3", fn, ref, 2 * n**3, mm_peak, budget_s))
        with config.override(gemm="template"):  # compiled and run under the setting: ember's Triton template
            templated = _ember(lambda x, y: x @ y)
            out.insert(len(out) - 1,  # before the hand-written kernel
                _rung("matmul", "ember, gemm=template", dev, f"{n}^3", lambda: templated(a, b), ref, 2 * n**3,
                      mm_peak, budget_s)
            )  # fmt: skip
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    x = torch.randn(rows, cols, device=dev, generator=g)
    w, bias = torch.randn(cols, device=dev, generator=g), torch.randn(cols, device=dev, generator=g)
    ref = layernorm_gelu_torch(x.double(), w.double(), bias.double()).cpu()
    moved = (2 * rows * cols + 2 * cols) * 4
    ln = _ember(layernorm_gelu_torch)
    for name, fn in [
        ("eager PyTorch", lambda: layernorm_gelu_torch(x, w, bias)),
        ("ember", lambda: ln(x, w, bias)),
        ("hand-written Triton", lambda: ladder_triton.layernorm_gelu(x, w, bias, EPS)),
    ]:
        out.append(_rung("layernorm_gelu", name, dev, f"{rows}x{cols}", fn, ref, moved, bw_peak, budget_s))
    return out


# -- output ----------------------------------------------------------------------------------------


def table(rungs: list[Rung], peaks: dict) -> str:
    lines = []
    for device, p in peaks.items():
        lines.append(
            f"{device}: measured peak {p['flops']['float32'] / 1e9:.1f} GFLOP/s fp32 matmul, "
            f"{p['bandwidth_Bps'] / 1e9:.1f} GB/s copy"
        )
    lines.append(f"{'op':<16}{'rung':<24}{'device':<8}{'size':<12}{'ms':>11}{'rate':>12}{'unit':<9}{'% peak':>8}")
    for r in rungs:
        if r.error:
            lines.append(f"{r.op:<16}{r.rung:<24}{r.device:<8}{r.size:<12}  failed: {r.error}")
            continue
        lines.append(
            f"{r.op:<16}{r.rung:<24}{r.device:<8}{r.size:<12}{r.ms:>11.4f}{r.rate:>12.3f} {r.unit:<8}"
            f"{r.percent_of_peak:>8.2f}"
        )
    return "\n".join(lines)


def plot(rungs: list[Rung], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, op, title in zip(axes, ("matmul", "layernorm_gelu"), ("matmul (GFLOP/s)", "layer norm + GELU (GB/s)")):
        rows = [r for r in rungs if r.op == op and not r.error]
        labels = [f"{r.rung}\n({r.device})" for r in rows]
        bars = ax.bar(
            range(len(rows)), [r.rate for r in rows], color=["#888" if r.device == "cpu" else "#1a4f9c" for r in rows]
        )
        ax.set_yscale("log")
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        for bar, r in zip(bars, rows):
            ax.annotate(f"{r.percent_of_peak:.2g}%", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=8)  # fmt: skip
    fig.suptitle("the abstraction ladder: rate per rung, % of the device's measured peak above each bar")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ember ladder", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=["small", "cpu", "gpu"], default=None, help="sizes (default: the device's)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timing per rung (default 0.5)")
    p.add_argument("--cpu-only", action="store_true", help="leave out the GPU rungs")
    p.add_argument("--plot", help="write the plot (PNG) to this file")
    p.add_argument("--json", help="write the rungs as JSON to this file")
    args = p.parse_args(argv)
    size = args.size or ("gpu" if torch.cuda.is_available() else "cpu")
    rungs, peaks = climb(size, args.budget, gpu=False if args.cpu_only else None)
    print(table(rungs, peaks))
    if args.plot:
        plot(rungs, args.plot)
        print(f"wrote {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peaks": peaks, "rungs": [asdict(r) for r in rungs]}, f, indent=1)
    return 1 if any(r.error for r in rungs) else 0


if __name__ == "__main__":
    sys.exit(main())
