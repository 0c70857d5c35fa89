"""The host program enforces extern output layouts that aliases and kernels rely on.

A LLaMA block's rotary-embedded q is realized row-major by ember where eager (and the FX meta)
keep it transposed; SDPA's output layout follows q's, so it differs from its meta. The later
`y.transpose(1, 2).reshape(...)` is an alias made with the meta's strides: before the host
program checked extern layouts for alias bases, this returned wrong numbers without a warning.
"""

import copy

import torch

from ember.tools.workloads import LlamaBlock
from tests.helpers import assert_close


def test_alias_of_extern_output_with_unexpected_layout_is_correct():
    torch.manual_seed(0)
    model = LlamaBlock(64, 4, 172, 32)
    x = torch.randn(2, 32, 64)
    with torch.no_grad():
        expected = model(x)
        compiled = torch.compile(copy.deepcopy(model), backend="ember", options={"strict": True})
        got = compiled(x)
    line = "repro: LlamaBlock(64, 4, 172, 32) inference on randn(2, 32, 64), cpp backend"
    assert_close(got, expected, rtol=1e-4, atol=1e-5, what="llama block output", line=line)
