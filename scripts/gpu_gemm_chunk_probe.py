"""On the GPU: can cuBLAS + a separate epilogue pass get close to a fused epilogue by running in
chunks small enough that the epilogue reads the product back from L2?

linear_bias_gelu (x [8192, 4096] @ W[4096, 4096]^T + b, exact GELU, bf16). Variants: cuBLAS
alone; eager (addmm, then gelu); addmm then in-place gelu; the same in row chunks or column
chunks (each chunk's gelu right after its product, while the chunk is in L2); row chunks with
the gelu on a second stream (overlapping the next chunk's product); cuBLASLt's fused GELU
epilogue (`_addmm_activation`, the tanh approximation: a reference, not a candidate). Each is
checked against eager and timed (median of CUDA-event timings).

    python scripts/gpu_gemm_chunk_probe.py --out gemm_chunks.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from gpu_sdpa_backend_probe import median_ms  # this directory is on sys.path when run as a script

aten = torch.ops.aten


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gemm_chunks.json")
    ap.add_argument("--shape", default="8192,4096,4096")
    args = ap.parse_args()
    m, k, n = map(int, args.shape.split(","))
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()

    def cublas():
        torch.addmm(b, x, w.t(), out=y)

    def eager():
        return F.gelu(torch.addmm(b, x, w.t()))

    def inplace():
        torch.addmm(b, x, w.t(), out=y)
        aten.gelu_(y)
        return y

    def rows(c):
        def run():
            for r in range(0, m, m // c):
                part = y[r : r + m // c]
                torch.addmm(b, x[r : r + m // c], w.t(), out=part)
                aten.gelu_(part)
            return y

        return run

    def cols(c):
        def run():
            step = n // c
            for j in range(0, n, step):
                part = y[:, j : j + step]
                torch.addmm(b[j : j + step], x, w[j : j + step].t(), out=part)
                aten.gelu_(part)
            return y

        return run

    def rows_two_streams(c):
        def run():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            for r in range(0, m, m // c):
                part = y[r : r + m // c]
                torch.addmm(b, x[r : r + m // c], w.t(), out=part)
                done = torch.cuda.Event()
                done.record(main)
                with torch.cuda.stream(side):
                    side.wait_event(done)
                    aten.gelu_(part)
            main.wait_stream(side)
            return y

        return run

    def cublaslt_tanh():
        return torch._addmm_activation(b, x, w.t(), use_gelu=True)

    variants = {"eager": eager, "addmm_then_inplace_gelu": inplace, "cublaslt_gelu_tanh (reference)": cublaslt_tanh}
    for c in (2, 4, 8, 16):
        variants[f"rows_{c}"] = rows(c)
        variants[f"cols_{c}"] = cols(c)
        variants[f"rows_{c}_two_streams"] = rows_two_streams(c)

    ref = F.gelu(x.float() @ w.float().t() + b.float())
    flops = 2 * m * n * k
    rows_out = [{"variant": "cublas_addmm_alone", "ms": median_ms(cublas)}]
    for name, fn in variants.items():
        y.fill_(float("nan"))
        out = fn()
        torch.cuda.synchronize()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        rows_out.append({"variant": name, "ms": median_ms(fn), "err": err})
    for r in rows_out:
        r["tflops"] = flops / (r["ms"] / 1e3) / 1e12
    sq = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    sq_ms = min(median_ms(lambda: sq @ sq) for _ in range(3))
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": [m, k, n]}
    meta["square_8192_tflops_median"] = 2 * 8192**3 / (sq_ms / 1e3) / 1e12
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows_out}, f, indent=1)
    print(meta)
    for r in rows_out:
        print(f"{r['variant']:34} {r['ms']:8.4f} ms {r['tflops']:6.0f} TFLOP/s  err {r.get('err', 0):.1e}")


if __name__ == "__main__":
    main()
