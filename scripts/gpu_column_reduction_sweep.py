"""On the GPU: launch configs and split sizes for column reductions (a LayerNorm weight's gradient).

    PYTHONPATH=. python scripts/gpu_column_reduction_sweep.py [--out results.jsonl]

sum over 8192 rows of (x - mean) * rstd * grad, [8192, 768] fp32 (gpt2_blocks' LayerNorm weight
gradient, 50 MB read): schedule/split.py splits it into a first stage over [S, 8192/S, 768] that
reduces across rows (memory contiguous along the kept dim) and a tiny second stage. For each
(chunk, target partials) split setting and each (XBLOCK, RBLOCK, warps) config of the
across-rows kernels: check against eager, time (median), and print the bandwidth reached.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch

os.environ.setdefault("EMBER_CACHE_DIR", tempfile.mkdtemp())


def weight_grad(x, mean, rstd, g):
    return ((x - mean) * rstd * g).sum(dim=0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="column_sweep.jsonl")
    args = p.parse_args()
    import triton.testing

    import ember.codegen.triton as tcg
    from ember.frontend.backend import ember_backend
    from ember.schedule import split
    from ember.schedule.cost import target_for

    dev = torch.device("cuda")
    bw = target_for(dev).bandwidth
    x, g = torch.randn(8192, 768, device=dev), torch.randn(8192, 768, device=dev)
    mean, rstd = torch.randn(8192, 1, device=dev), torch.rand(8192, 1, device=dev) + 0.5
    args_ = (x, mean, rstd, g)
    want = weight_grad(*args_)
    moved = 2 * x.nbytes + 2 * mean.nbytes + want.nbytes
    original = tcg.launch_config
    eager_ms = triton.testing.do_bench(lambda: weight_grad(*args_), warmup=25, rep=200, return_mode="median")
    print(json.dumps({"eager_ms": eager_ms, "eager_bw": moved / (eager_ms / 1e3) / bw}), flush=True)
    rows = []
    splits = [(256, 32768), (128, 65536), (512, 16384), (64, 131072), (1024, 8192)]
    configs = [None, (32, 128, 4), (64, 64, 4), (128, 64, 8), (128, 32, 4), (256, 32, 8), (128, 128, 8), (64, 256, 8)]
    for chunk, target in splits:
        split.MIN_CHUNK, split.TARGET_PARTIALS = chunk, target
        for cfg in configs:

            def patched(kernel, cfg=cfg):
                base = original(kernel)
                if cfg is None or not tcg._reduces_across_rows(kernel):
                    return base
                return tcg.LaunchConfig(cfg[0], cfg[1], cfg[2], False)

            tcg.launch_config = patched
            torch._dynamo.reset()
            row = {"chunk": chunk, "partials": target, "config": cfg or "default"}
            try:
                fn = torch.compile(weight_grad, backend=ember_backend)
                got = fn(*args_)
                row["ok"] = bool(torch.allclose(got, want, rtol=1e-3, atol=1e-2))
                ms = triton.testing.do_bench(lambda fn=fn: fn(*args_), warmup=25, rep=200, return_mode="median")
                row.update(ms=ms, bw_fraction=moved / (ms / 1e3) / bw)
            except Exception as e:  # noqa: BLE001 - a config Triton cannot compile is a result
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            finally:
                tcg.launch_config = original
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    ok = [r for r in rows if "ms" in r]
    for r in sorted(ok, key=lambda r: r["ms"])[:8]:
        print(
            f"{r['ms'] * 1e3:7.1f} us {100 * r['bw_fraction']:5.1f}% chunk {r['chunk']} partials {r['partials']} {r['config']} ok={r['ok']}"
        )


if __name__ == "__main__":
    main()
