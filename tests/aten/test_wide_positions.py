"""Integer positions past 2**31 keep their values: flat offsets into large tensors (`arange(B)[:, None] * (S * V)`)
are int64 arithmetic, though a kernel over few elements indexes with 32 bits. (Lowered to the kernel's own index,
`arange(0, 2**34, 2**30)` wrapped to negative values on the Triton target.)"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ON_DEVICES, assert_no_fallback, ember_compile, reports, repro


def wide_offsets(x):
    n = x.shape[0]
    return x + torch.arange(0, 2**34, 2**30, device=x.device) + torch.arange(n, device=x.device) * 2**29 + 7


@pytest.mark.parametrize("backend,device", ON_DEVICES)
@pytest.mark.parametrize("dynamic", [False, True])
def test_positions_past_int32_keep_their_values(backend, device, dynamic):
    x = torch.randint(-5, 5, (16,), device=device)
    line = repro(backend=backend, device=device, dynamic=dynamic)
    with reports() as report:
        got = ember_compile(wide_offsets, backend, dynamic=dynamic)(x)
    assert_no_fallback(report, line)
    assert torch.equal(got, wide_offsets(x)), f"{got.tolist()}\n{line}"
