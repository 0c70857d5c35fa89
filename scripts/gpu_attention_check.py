"""Attention on the GPU: ember vs Inductor vs eager, correctness and time (issue 5, attention).

For the lead to run on the GPU machine (needs CUDA and triton):

    python scripts/gpu_attention_check.py                       # all programs, bf16, fwd and fwd+bwd
    python scripts/gpu_attention_check.py --programs naive,sdpa_causal --shape 8,16,2048,64

Programs (q, k, v of shape B, H, S, D, bf16):
  naive        ember.tools.workloads.attention_manual: softmax(q @ k^T * d^-0.5) @ v (bench "attention")
  sdpa_causal  ember.tools.workloads.sdpa_causal: F.scaled_dot_product_attention(is_causal=True)
  naive_causal q @ k.mT / sqrt(d), masked_fill(~tril, -inf), softmax in fp32, cast back, @ v
  naive_3d     the same as `naive` over [B*H, S, D] with torch.bmm

Columns: eager, ember (attention pass on, the default), ember with EMBER_PATTERNS off (the old
path: two bmm externs and a softmax kernel), Inductor default. For each: median time
(triton.testing.do_bench), first-call time (compile), peak memory, and the largest error of the
outputs and of dq, dk, dv against an fp32 reference computed from the same bf16 inputs, next to
eager bf16's own error. For ember also: how many graphs the pass rewrote and the externs that run.
Writes results.json to $OUT (or ./gpu_attention_out).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import traceback

import torch
import torch._dynamo
import torch.nn.functional as F
import triton.testing

import ember  # noqa: F401
from ember.report import collecting
from ember.tools.workloads import attention_manual, sdpa_causal


def naive_causal(q, k, v):
    n = q.size(-2)
    scores = torch.matmul(q, k.mT) / math.sqrt(q.size(-1))
    keep = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
    probs = F.softmax(scores.masked_fill(~keep, float("-inf")).float(), dim=-1).to(q.dtype)
    return torch.matmul(probs, v)


def naive_3d(q, k, v):
    B, H, S, D = q.shape
    q, k, v = (t.reshape(B * H, S, D) for t in (q, k, v))
    p = torch.bmm(q, k.transpose(1, 2)).div(math.sqrt(D)).softmax(dim=-1)
    return torch.bmm(p, v).view(B, H, S, D)


PROGRAMS = {"naive": attention_manual, "sdpa_causal": sdpa_causal, "naive_causal": naive_causal, "naive_3d": naive_3d}
COMPILERS = ("eager", "ember", "ember_no_patterns", "inductor")


def build(compiler: str, fn):
    torch._dynamo.reset()
    if compiler == "eager":
        return fn
    if compiler == "inductor":
        return torch.compile(fn)
    return torch.compile(fn, backend="ember", options={"patterns": compiler == "ember"})


def step(fn, q, k, v, cot, train: bool):
    if not train:
        with torch.no_grad():
            return [fn(q, k, v)]
    out = fn(q, k, v)
    return [out.detach(), *torch.autograd.grad(out, (q, k, v), cot)]


def max_err(a, ref) -> float:
    return (a.float() - ref.float()).abs().max().item()


def check(name: str, shape, train: bool, compilers, reps: int) -> list[dict]:
    fn = PROGRAMS[name]
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    cot = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    leaves = [t.requires_grad_(train) for t in (q, k, v)]
    ref_leaves = [t.detach().float().requires_grad_(train) for t in leaves]
    ref = step(fn, *ref_leaves, cot.float(), train)
    eager_err = [max_err(a, r) for a, r in zip(step(fn, *leaves, cot, train), ref, strict=True)]
    rows = []
    for compiler in compilers:
        row = {"program": name, "mode": "fwd+bwd" if train else "fwd", "compiler": compiler, "shape": list(shape)}
        try:
            compiled = build(compiler, fn)
            with collecting() as report:
                torch.cuda.synchronize()
                start = time.perf_counter()
                outs = step(compiled, *leaves, cot, train)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - start, 3)
            torch.cuda.reset_peak_memory_stats()
            step(compiled, *leaves, cot, train)
            row["peak_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
            row["ms"] = triton.testing.do_bench(lambda c=compiled: step(c, *leaves, cot, train), rep=reps)
            errs = [max_err(a, r) for a, r in zip(outs, ref, strict=True)]
            scale = max(r.abs().max().item() for r in ref)
            row["max_err"] = errs
            row["eager_err"] = eager_err
            # bf16 against the fp32 reference: not more than 2x eager's error plus one bf16 ulp of the scale.
            row["ok"] = all(e <= 2 * ee + scale * 2**-8 for e, ee in zip(errs, eager_err, strict=True))
            if compiler.startswith("ember"):
                row["fallbacks"] = [g.fallback for g in report.graphs if g.fallback]
                row["externs"] = sorted({e for g in report.graphs for e in g.externs})
                row["kernels"] = sum(len(g.kernels) for g in report.graphs)
        except Exception as e:  # noqa: BLE001 (one failing compiler must not hide the others' rows)
            row["error"] = f"{type(e).__name__}: {e}"[:400]
            traceback.print_exc()
        rows.append(row)
        print(format_row(row), flush=True)
    return rows


def format_row(r: dict) -> str:
    head = f"{r['program']:<13} {r['mode']:<8} {r['compiler']:<18}"
    if "error" in r:
        return f"{head} ERROR {r['error']}"
    errs = "/".join(f"{e:.2g}" for e in r["max_err"])
    line = (
        f"{head} {r['ms']:8.3f} ms  first {r['first_call_s']:6.2f} s  peak {r['peak_mb']:8.1f} MB  "
        f"err {errs} (eager {'/'.join(f'{e:.2g}' for e in r['eager_err'])})  {'ok' if r['ok'] else 'WRONG'}"
    )
    if "externs" in r:
        line += f"  kernels {r['kernels']} externs {','.join(r['externs']) or '-'}"
        if r["fallbacks"]:
            line += f"  FALLBACK {r['fallbacks']}"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--programs", default=",".join(PROGRAMS))
    ap.add_argument("--shape", default="8,16,2048,64", help="B,H,S,D (the bench's gpu scale)")
    ap.add_argument("--compilers", default=",".join(COMPILERS))
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--rep", type=int, default=200, help="do_bench time budget per row, ms")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    shape = tuple(int(x) for x in args.shape.split(","))
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  shape {shape}")
    rows = []
    for name in args.programs.split(","):
        for mode in args.modes.split(","):
            rows += check(name, shape, mode == "fwd+bwd", args.compilers.split(","), args.rep)
    print("\nember / Inductor time (lower is better):")
    for name in args.programs.split(","):
        for mode in args.modes.split(","):
            t = {r["compiler"]: r.get("ms") for r in rows if r["program"] == name and r["mode"] == mode}
            if t.get("ember") and t.get("inductor"):
                print(f"  {name:<13} {mode:<8} {t['ember'] / t['inductor']:.2f}x")
    out_dir = os.environ.get("OUT") or "gpu_attention_out"
    os.makedirs(out_dir, exist_ok=True)
    meta = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {out_dir}/results.json")


if __name__ == "__main__":
    main()
