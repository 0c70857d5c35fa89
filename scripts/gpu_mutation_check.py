"""Input mutations on the GPU: batch norm's running statistics and a user's in-place update,
ember against eager on CUDA (fp32 and bf16 autocast), after several training steps.

    PYTHONPATH=. python scripts/gpu_mutation_check.py
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from ember.frontend.backend import ember_backend
from ember.report import collecting


def bn_model():
    return nn.Sequential(
        # No conv bias: before a batch norm its gradient is exactly zero, and a relative error of noise
        nn.Conv2d(16, 32, 3, padding=1, bias=False),
        nn.BatchNorm2d(32),
        nn.ReLU(),
        nn.Conv2d(32, 32, 1, bias=False),
        nn.BatchNorm2d(32),
    )


def check_batch_norm(autocast: bool, channels_last: bool, backend=ember_backend) -> bool:
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = bn_model().cuda().train().to(memory_format=fmt)
    reference = copy.deepcopy(model)
    compiled = torch.compile(model, backend=backend)
    # A random cotangent: mean(bn(x)**2) would have a zero gradient upstream (batch norm removes scale)
    cotangent = torch.randn(8, 32, 32, 32, device="cuda")
    with collecting() as report:
        for _ in range(4):
            x = torch.randn(8, 16, 32, 32, device="cuda").contiguous(memory_format=fmt)
            with torch.autocast("cuda", torch.bfloat16, enabled=autocast):
                (compiled(x).float() * cotangent).sum().backward()
                (reference(x).float() * cotangent).sum().backward()
    errors = {}
    for (name, got), (_, want) in zip(model.named_buffers(), reference.named_buffers()):
        errors[name] = float((got.double() - want.double()).abs().max() / (want.double().abs().max() + 1e-12))
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        errors[f"{name}.grad"] = float((p.grad - q.grad).norm() / (q.grad.norm() + 1e-12))
    worst = max(errors.values())
    memory = [g.memory for g in report.graphs if g.kind == "forward"]
    fallbacks = [g.fallback for g in report.graphs if g.fallback]
    ok = worst < (2e-2 if autocast else 1e-3) and not fallbacks
    name = backend if isinstance(backend, str) else "ember"
    print(f"{'ok  ' if ok else 'FAIL'} {name} batch norm autocast={autocast} channels_last={channels_last}: "
          f"worst {worst:.1e}; {memory}; fallbacks {fallbacks}")  # fmt: skip
    if not ok:
        print("     ", {k: f"{v:.1e}" for k, v in errors.items()})
    return ok


def accumulate(x, acc):
    acc.add_(x * 2)
    return x.sin()


def overwrite(x, buf):
    old = buf * 3
    buf.copy_(x)
    return old + 1


def check_user_mutation(fn) -> bool:
    x, buf = torch.randn(64, 96, device="cuda"), torch.randn(64, 96, device="cuda")
    buf_ref = buf.clone()
    got = torch.compile(fn, backend=ember_backend)(x, buf)
    want = fn(x, buf_ref)
    ok = torch.allclose(got, want, rtol=1e-5, atol=1e-5) and torch.allclose(buf, buf_ref, rtol=1e-5, atol=1e-5)
    print(f"{'ok  ' if ok else 'FAIL'} user mutation {fn.__name__}")
    return ok


if __name__ == "__main__":
    results = [check_batch_norm(a, c) for a in (False, True) for c in (False, True)]
    check_batch_norm(True, True, "inductor")  # the same comparison for Inductor: what noise looks like
    results += [check_user_mutation(f) for f in (accumulate, overwrite)]
    print(f"{results.count(False)} failure(s)")
