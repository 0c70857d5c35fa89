"""A long chain of fused pointwise steps: the kernel builder walks it one Python frame per step,
and must compile it, not fall back on a RecursionError."""

import torch

from tests.helpers import assert_close, ember_compile, repro


def chain(x: torch.Tensor, steps: int) -> torch.Tensor:
    for _ in range(steps):
        x = torch.sin(x) * 1.01
    return x


def test_chain_longer_than_the_default_recursion_limit():
    steps = 400  # ~1,200 frames of the expression walk: past Python's default limit of 1,000
    x = torch.randn(4, 8)
    compiled = ember_compile(lambda t: chain(t, steps), "cpp")
    line = repro(program="chain", steps=steps, x=x)
    assert_close(compiled(x), chain(x, steps), rtol=1e-4, atol=1e-5, what="chain", line=line)
