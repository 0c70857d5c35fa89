"""On the GPU: launch configs and split sizes for column reductions (LayerNorm weight and bias gradients).

    PYTHONPATH=. python scripts/gpu_column_reduction_sweep.py [--out results.jsonl]

Cases (gpt2_blocks' training shapes): a LayerNorm's weight and bias gradients from bf16 x and
grad with fp32 row statistics, [16384, 768]; the same in fp32 at [8192, 768]; a bias gradient
alone, [16384, 768] and [16384, 3072] bf16. schedule/split.py splits each into a first stage
over [S, rows/S, cols] that reduces across rows (memory contiguous along the kept dim) and a
tiny second stage. For each split setting and each (XBLOCK, RBLOCK, warps) config of the
across-rows kernels: check against eager and record the device time of the generated kernels
per call (torch.profiler, so host time is not in it), and the bandwidth that gives. Inductor's
device time for the same function is the reference.

Session 6's version timed whole calls with do_bench (the host program's time when it is longer
than the kernels') and its configs never applied: the row statistics made `_reduces_across_rows`
answer no, so the kernel kept its persistent config whatever the sweep set.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("EMBER_CACHE_DIR", tempfile.mkdtemp())


def ln_grads(x, mean, rstd, g):
    xf, gf = x.float(), g.float()
    return ((xf - mean) * rstd * gf).sum(0), gf.sum(0)


def bias_grad(g):
    return (g.float().sum(0),)  # a tuple, as ln_grads returns


def _cases(dev):
    def ln(rows, dtype):
        x, g = torch.randn(rows, 768, device=dev, dtype=dtype), torch.randn(rows, 768, device=dev, dtype=dtype)
        mean, rstd = torch.randn(rows, 1, device=dev), torch.rand(rows, 1, device=dev) + 0.5
        return ln_grads, (x, mean, rstd, g)

    return {
        "ln_grads_bf16_16384x768": ln(16384, torch.bfloat16),
        "ln_grads_f32_8192x768": ln(8192, torch.float32),
        "bias_bf16_16384x768": (bias_grad, (torch.randn(16384, 768, device=dev, dtype=torch.bfloat16),)),
        "bias_bf16_16384x3072": (bias_grad, (torch.randn(16384, 3072, device=dev, dtype=torch.bfloat16),)),
    }


def device_us(fn, args, calls: int = 20) -> float:
    """Device time of all kernels per call."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    return sum(e.device_time for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA) / calls


def _moved(args, outs) -> int:
    return sum(a.nbytes for a in args) + sum(o.nbytes for o in outs)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="column_sweep.jsonl")
    args = p.parse_args()

    import ember.codegen.triton as tcg
    from ember.frontend.backend import ember_backend
    from ember.schedule import split
    from ember.schedule.cost import target_for

    dev = torch.device("cuda")
    bw = target_for(dev).bandwidth
    original = tcg.launch_config
    defaults = (split.MIN_CHUNK, split.TARGET_PARTIALS)
    splits = [defaults, (256, 65536), (1024, 16384), (128, 131072)]
    configs = [None, (64, 64, 4), (128, 32, 4), (128, 64, 8), (256, 16, 4), (256, 32, 8), (64, 32, 4), (32, 64, 4)]
    rows = []
    for name, (fn, inputs) in _cases(dev).items():
        want = fn(*inputs)
        moved = _moved(inputs, want)
        torch._dynamo.reset()
        inductor = torch.compile(fn)
        ref = {"case": name, "compiler": "inductor", "us": device_us(inductor, inputs)}
        ref["bw_fraction"] = moved / (ref["us"] / 1e6) / bw
        print(json.dumps(ref), flush=True)
        rows.append(ref)
        for chunk, target in splits:
            split.MIN_CHUNK, split.TARGET_PARTIALS = chunk, target
            for cfg in configs:

                def patched(kernel, cfg=cfg):
                    base = original(kernel)
                    if cfg is None or not tcg._reduces_across_rows(tcg._tile_loads(kernel)):
                        return base
                    return tcg.LaunchConfig(cfg[0], cfg[1], cfg[2], False)

                tcg.launch_config = patched
                torch._dynamo.reset()
                row = {
                    "case": name,
                    "compiler": "ember",
                    "chunk": chunk,
                    "partials": target,
                    "config": cfg or "default",
                }
                try:
                    compiled = torch.compile(fn, backend=ember_backend)
                    got = compiled(*inputs)
                    row["ok"] = all(torch.allclose(a, b, rtol=1e-3, atol=5e-2) for a, b in zip(got, want))
                    row["us"] = device_us(compiled, inputs)
                    row["bw_fraction"] = moved / (row["us"] / 1e6) / bw
                except Exception as e:  # noqa: BLE001 - a config Triton cannot compile is a result
                    row["error"] = f"{type(e).__name__}: {e}"[:200]
                finally:
                    tcg.launch_config = original
                rows.append(row)
                print(json.dumps(row), flush=True)
        split.MIN_CHUNK, split.TARGET_PARTIALS = defaults
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    for name in sorted({r["case"] for r in rows}):
        case = [r for r in rows if r["case"] == name and "us" in r]
        ind = next(r for r in case if r["compiler"] == "inductor")
        print(f"{name}: inductor {ind['us']:.1f} us ({100 * ind['bw_fraction']:.0f}%)")
        for r in sorted([r for r in case if r["compiler"] == "ember"], key=lambda r: r["us"])[:5]:
            print(f"  {r['us']:7.1f} us {100 * r['bw_fraction']:5.1f}% chunk {r['chunk']} {r['config']} ok={r['ok']}")
        default = [
            r for r in case if r["compiler"] == "ember" and r["config"] == "default" and r["chunk"] == defaults[0]
        ]
        if default:
            print(f"  default: {default[0]['us']:.1f} us")


if __name__ == "__main__":
    main()
