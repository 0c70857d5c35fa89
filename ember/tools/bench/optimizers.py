"""Compiled optimizer steps: `opt.step` of torch.optim's AdamW, Adam and SGD with momentum, each in
its foreach form, over a flat list of equal parameters or over GPT-2 124M's parameter shapes.

The step changes what it holds (parameters and states), so the workload can put it back
(`Built.reset`) before each checked call and gives its float64 result (`Built.reference`: the same
optimizer, single-tensor form, on float64 copies of that state). The state is made by one eager
step when the workload is built, so the compiled step finds it and is compiled once. The learning
rates are large next to the parameters (0.01 scale) so that a wrong update is a visible error.

The bandwidth floor (`Built.bytes`): every parameter, gradient and state read once and every
parameter and state written once.

torch.optim keeps Adam's and AdamW's states in the parameters' dtype (its foreach and
single-tensor forms both refuse fp32 states beside bf16 parameters: `lerp` takes one dtype), so
the bf16 rows keep bf16 states there; SGD's momentum buffer is fp32 beside bf16 parameters.
"""

from __future__ import annotations

import torch

from ember.tools.bench.built import Built

_HYPER = {
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 1e-2}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def gpt2_shapes(layers: int = 12, d: int = 768, vocab: int = 50257, positions: int = 1024) -> list[tuple]:
    """The parameter shapes of GPT-2 (124M at the defaults; the head is tied to the embedding)."""
    block = [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    return [(vocab, d), (positions, d)] + block * layers + [(d,), (d,)]


def _shapes(size: tuple) -> list[tuple]:
    if size[0] == "gpt2":
        return gpt2_shapes(*size[1:])
    count, numel = size
    return [(numel,)] * count


def describe(size: tuple) -> str:
    if size[0] == "gpt2":
        n = sum(torch.Size(s).numel() for s in gpt2_shapes(*size[1:]))
        return f"GPT-2 shapes, {size[1]} layers, {n / 1e6:.1f}M params"
    count, numel = size
    return f"{count} × {numel / 1e6:.3g}M params" if numel >= 1e5 else f"{count} × {numel} params"


def optimizer_step(kind: str, dtype: torch.dtype):
    """The builder of `opt.step` for optimizer `kind` with parameters of `dtype`."""

    def build(size: tuple, device: torch.device) -> Built:
        cls, hyper = _HYPER[kind]
        gen = torch.Generator(device=device).manual_seed(0)
        params = [0.01 * torch.randn(s, generator=gen, device=device, dtype=dtype) for s in _shapes(size)]
        for p in params:
            p.grad = 0.01 * torch.randn(p.shape, generator=gen, device=device, dtype=dtype)
        opt = cls(params, foreach=True, **hyper)
        opt.step()  # makes the state
        if kind == "sgd_momentum" and dtype != torch.float32:
            for p in params:
                opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].float()
        saved = _snapshot(params, opt)

        def step():
            opt.step()
            return params

        def reset():
            with torch.no_grad():
                for p, (p0, state0) in zip(params, saved):
                    p.copy_(p0)
                    for k, v in state0.items():
                        opt.state[p][k].copy_(v)

        def reference() -> list[torch.Tensor]:
            ref = [p0.double() for p0, _ in saved]
            for r, p in zip(ref, params):
                r.grad = p.grad.double()
            ref_opt = cls(ref, foreach=False, **hyper)
            for r, (_, state0) in zip(ref, saved):
                ref_opt.state[r] = {k: v.clone() if k == "step" else v.double() for k, v in state0.items()}
            ref_opt.step()
            return ref

        return Built(step, (), reset=reset, reference=reference, bytes=floor_bytes(params, opt))

    return build


def _snapshot(params: list[torch.Tensor], opt) -> list[tuple]:
    return [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()}) for p in params]


def floor_bytes(params: list[torch.Tensor], opt) -> int:
    """Parameters, gradients and states read once; parameters and states written once (a step
    counter on the CPU is not device traffic)."""
    total = 0
    for p in params:
        states = [v for v in opt.state[p].values() if v.device == p.device and v.numel() == p.numel()]
        rw = p.numel() * p.element_size() + sum(v.numel() * v.element_size() for v in states)
        total += 2 * rw + p.grad.numel() * p.grad.element_size()
    return total
