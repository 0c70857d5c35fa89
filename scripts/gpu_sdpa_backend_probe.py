"""On the GPU: which of PyTorch's fused attention kernels is fastest at the benchmark's shapes?

For each attention shape of the benchmark workloads, SDPA forward and forward + backward under
each backend `torch.nn.attention.sdpa_kernel` can force (flash, cuDNN, memory-efficient) and
under PyTorch's own choice: median device time (CUDA events over many calls) and the error of
the output and gradients against an fp32 math-backend reference (‖out − ref‖ / ‖ref‖).

    PYTHONPATH=. python scripts/gpu_sdpa_backend_probe.py --out sdpa_backends.json
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# (name, B, H, S, D, causal, mask): the shapes of the benchmark's attention.
SHAPES = [
    ("attention", 8, 16, 2048, 64, False, False),
    ("sdpa_causal", 8, 16, 2048, 64, True, False),
    ("gpt2_blocks", 16, 12, 1024, 64, True, False),
    ("hf_gpt2", 8, 12, 1024, 64, True, False),
    ("hf_bert", 32, 12, 512, 64, False, True),
    ("llama_block", 4, 32, 2048, 128, True, False),
    ("vit_b_16", 64, 12, 197, 64, False, False),
]
BACKENDS = {
    "default": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def median_ms(fn, reps: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref).norm() / ref.norm()).item()


def probe(name, b, h, s, d, causal, masked) -> list[dict]:
    dev = "cuda"
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    mask = None
    if masked:  # BERT's: padding of the last keys of some rows, as an additive bf16 mask
        keep = torch.ones(b, 1, s, s, device=dev, dtype=torch.bool)
        keep[: b // 2, :, :, s - s // 4 :] = False
        mask = torch.zeros(b, 1, s, s, device=dev, dtype=torch.bfloat16).masked_fill(~keep, float("-inf"))
    grad = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16)
    kw = {"attn_mask": mask, "is_causal": causal}

    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([SDPBackend.MATH]):
        ref = F.scaled_dot_product_attention(
            qf, kf, vf, attn_mask=None if mask is None else mask.float(), is_causal=causal
        )
    ref.backward(grad.float())
    refs = [ref.detach(), qf.grad, kf.grad, vf.grad]

    rows = []
    for label, backend in BACKENDS.items():
        row = {"shape": name, "backend": label, "B": b, "H": h, "S": s, "D": d, "causal": causal, "mask": masked}
        ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()
        try:
            with ctx:
                for t in (q, k, v):
                    t.grad = None
                out = F.scaled_dot_product_attention(q, k, v, **kw)
                out.backward(grad)
                row["err"] = [rel(x, r) for x, r in zip([out, q.grad, k.grad, v.grad], refs)]

                def fwd():
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v, **kw)

                def step():
                    for t in (q, k, v):
                        t.grad = None
                    F.scaled_dot_product_attention(q, k, v, **kw).backward(grad)

                row["fwd_ms"] = median_ms(fwd)
                row["train_ms"] = median_ms(step)
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    fwd()
                    torch.cuda.synchronize()
                prof_names = sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
                row["fwd_kernels"] = [n[:90] for n in prof_names]
        except Exception as e:  # noqa: BLE001 - a backend that does not take this shape
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sdpa_backends.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for shape in SHAPES:
        rows += probe(*shape)
        torch.cuda.empty_cache()
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(meta)
    print(f"{'shape':12} {'backend':10} {'fwd ms':>8} {'train ms':>9}  max err")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:12} {r['backend']:10} {r['error'][:70]}")
        else:
            print(f"{r['shape']:12} {r['backend']:10} {r['fwd_ms']:8.3f} {r['train_ms']:9.3f}  {max(r['err']):.2e}")


if __name__ == "__main__":
    main()
