"""The cat / constant_pad_nd / max_pool2d lowerings on the GPU (real Triton, not the interpreter):
the programs of tests/aten/test_cat_pad.py and test_max_pool.py on CUDA, forward and backward,
against eager. Prints one line per case and exits non-zero on any difference.

    PYTHONPATH=. python scripts/gpu_lowering_check.py
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from ember.frontend.backend import register
from ember.report import collecting
from tests.aten.test_cat_pad import PROGRAMS
from tests.aten.test_max_pool import CASES, _input

register()
torch._dynamo.config.cache_size_limit = 256
failures = 0


def report(name: str, ok: bool, detail: str = "") -> None:
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)


def grads_of(fn, inputs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    gen = torch.Generator(device="cuda").manual_seed(1)
    cot = torch.randn(out.shape, generator=gen, device="cuda", dtype=out.dtype)
    return [out.detach()] + list(torch.autograd.grad(out, leaves, cot))


for name, (fn, shapes) in PROGRAMS.items():
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [torch.randn(s, device="cuda").to(dtype) for s in shapes]
        torch._dynamo.reset()
        with collecting() as rep:
            got = grads_of(torch.compile(fn, backend="ember"), inputs)
        want = grads_of(fn, inputs)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        errs = [(g.float() - w.float()).abs().max().item() for g, w in zip(got, want)]
        externs = sorted({str(e) for g in rep.graphs for e in g.externs})
        ok = all(e <= tol * 4 for e in errs) and not any(g.fallback for g in rep.graphs)
        report(f"{name} {dtype}", ok, f"max errs {['%.1e' % e for e in errs]} externs {externs}")

for name, (shape, k, s, p, ceil, channels_last) in CASES.items():
    for dtype in (torch.float32, torch.bfloat16):
        x = _input(shape, channels_last).to(device="cuda", dtype=dtype)

        def pool(t, k=k, s=s, p=p, ceil=ceil):
            return F.max_pool2d(t, k, s, p, ceil_mode=ceil, return_indices=True)

        torch._dynamo.reset()
        with collecting() as rep:
            values, indices = torch.compile(pool, backend="ember")(x)
            xg = x.clone().requires_grad_()
            torch.compile(lambda t: pool(t)[0].nan_to_num(0.0, 5.0, -5.0).sum(), backend="ember")(xg).backward()
        want_values, want_indices = pool(x)
        xe = x.clone().requires_grad_()
        pool(xe)[0].nan_to_num(0.0, 5.0, -5.0).sum().backward()
        ok = (
            torch.equal(indices, want_indices)
            and torch.equal(values.nan_to_num(1e9), want_values.nan_to_num(1e9))
            and torch.equal(xg.grad, xe.grad)
            and not any(g.fallback for g in rep.graphs)
        )
        externs = sorted({str(e) for g in rep.graphs for e in g.externs})
        report(f"max_pool {name} {dtype}", ok, f"externs {externs}")

print(f"{failures} failure(s)")
sys.exit(1 if failures else 0)
