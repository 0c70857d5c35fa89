"""On the GPU: batch norm + ReLU training at ResNet-50's shapes, ember against Inductor.

    PYTHONPATH=. python scripts/gpu_batch_norm_sweep.py [--out bn_sweep.jsonl] [--variants a,b]

Each case is BatchNorm2d + ReLU on a channels-last bf16 activation [64, C, H, H] under bf16
autocast, forward and backward (the gradient given, the input's and the parameters' gradients
reset each call). Its device time per call is the sum of the kernels' times under
torch.profiler, so host time is not in it. Variants change the scheduler's split rule for
column reductions, its rule for storing shared pointwise values, and the launch config of the
kernels that reduce across rows (codegen/triton.py's column sums), by patching them:

- before: session 10's rules (column reductions split from 4096 rows; a shared pointwise value
  of two large inputs stored whatever the bytes);
- default: the code as it is;
- cfg XxRxW: default, with column-sum kernels of X columns by R rows a step and W warps;
- chunk64: default, with chunks of 64 rows at least;
- second N: default, with the second reduced dim (H) split into at most N chunks when the batch
  is split whole (split.MAX_SECOND_SPLIT; second1: only the batch splits, as in session 11);
- anychannels: default, with H split at any channel count (not only when the batch split
  leaves at most one program per SM);
- longfinal: default, with the second stage of a split walked in steps of 128 rows as the first
  (codegen/triton.py's SHORT_COLUMNS off).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile

os.environ.setdefault("EMBER_CACHE_DIR", tempfile.mkdtemp())

SHAPES = [(64, 112), (64, 56), (256, 56), (128, 28), (512, 28), (256, 14), (1024, 14), (512, 7), (2048, 7)]
CONFIGS = [(32, 128, 8), (64, 64, 8), (32, 64, 4), (64, 32, 4)]


def _case(channels: int, size: int, dev):
    module = torch.nn.Sequential(torch.nn.BatchNorm2d(channels), torch.nn.ReLU()).to(dev)
    x = torch.randn(64, channels, size, size, device=dev, dtype=torch.bfloat16)
    x = x.to(memory_format=torch.channels_last).requires_grad_()
    grad = torch.randn_like(x)

    def step(fn):
        x.grad = None
        for p in module.parameters():
            p.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(x)
        out.backward(grad)
        return out, x.grad, module[0].weight.grad

    return module, step


def device_us(step, fn, calls: int = 10) -> tuple[float, list]:
    """Device time of all kernels per call, and the kernels taking it."""
    for _ in range(3):
        step(fn)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step(fn)
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:60]] = kernels.get(e.name[:60], 0.0) + e.device_time / calls
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
    return sum(kernels.values()), [(n, round(us, 1)) for n, us in top]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bn_sweep.jsonl")
    p.add_argument("--variants", default="before,default," + ",".join(f"cfg{x}x{r}x{w}" for x, r, w in CONFIGS))
    p.add_argument("--shapes", default=",".join(f"{c}x{h}" for c, h in SHAPES))
    args = p.parse_args()

    import ember.codegen.triton as tcg
    from ember.frontend.backend import ember_backend
    from ember.schedule import fusion, split

    dev = torch.device("cuda")
    originals = (
        tcg.launch_config,
        fusion.worth_storing,
        split.MIN_COLUMN_REDUCE,
        split.MIN_CHUNK,
        split.MAX_SECOND_SPLIT,
    )
    factor = split._split_factor_of_dim

    def apply(variant: str) -> None:
        tcg.launch_config, fusion.worth_storing, split.MIN_COLUMN_REDUCE, split.MIN_CHUNK, split.MAX_SECOND_SPLIT = (
            originals
        )
        split._split_factor_of_dim = factor
        if variant == "before":
            split.MIN_COLUMN_REDUCE = split.MIN_REDUCE
            split.MAX_SECOND_SPLIT = 1
            split._split_factor_of_dim = lambda o, r, size, target: factor(o, r, size)
            fusion.worth_storing = lambda readers, large, itemsize: readers >= 2 and len(large) >= 2
        elif variant == "chunk64":
            split.MIN_CHUNK = 64
        elif variant == "anychannels":
            split.COLUMNS_PER_PROGRAM = 1 << 30
        elif variant == "longfinal":
            tcg.SHORT_COLUMNS = 0
        elif variant.startswith("second"):
            split.MAX_SECOND_SPLIT = int(variant[len("second") :])
        elif variant.startswith("cfg"):
            xb, rb, w = (int(v) for v in variant[3:].split("x"))

            def patched(kernel):
                base = originals[0](kernel)
                if base.persistent or not base.rblock or not tcg._reduces_across_rows(tcg._tile_loads(kernel)):
                    return base
                return tcg.LaunchConfig(xb, rb, w, False)

            tcg.launch_config = patched

    rows = []
    for shape in args.shapes.split(","):
        channels, size = (int(v) for v in shape.split("x"))
        module, step = _case(channels, size, dev)
        torch._dynamo.reset()
        want = [t.float().clone() for t in step(module)]
        torch._dynamo.reset()
        us, top = device_us(step, torch.compile(module))
        row = {"shape": shape, "compiler": "inductor", "us": round(us, 1), "top": top}
        print(json.dumps(row), flush=True)
        rows.append(row)
        for variant in args.variants.split(","):
            apply(variant)
            torch._dynamo.reset()
            row = {"shape": shape, "compiler": "ember", "variant": variant}
            try:
                compiled = torch.compile(module, backend=ember_backend, options={"strict": True})
                got = step(compiled)
                row["max_err"] = max(float((g.float() - w).abs().max()) for g, w in zip(got, want))
                us, top = device_us(step, compiled)
                row.update(us=round(us, 1), top=top)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a result
                row["error"] = f"{type(e).__name__}: {e}"[:200]
            finally:
                apply("default")
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print("\nshape        inductor   " + "  ".join(f"{v:>12}" for v in args.variants.split(",")))
    for shape in args.shapes.split(","):
        ind = next(r for r in rows if r["shape"] == shape and r["compiler"] == "inductor")
        cells = [r.get("us", float("nan")) for r in rows if r["shape"] == shape and r["compiler"] == "ember"]
        print(f"{shape:10} {ind['us']:9.1f}   " + "  ".join(f"{c:12.1f}" for c in cells))


if __name__ == "__main__":
    main()
