"""split and chunk as slice views: static pieces, and pieces of a symbolic length (chunk under dynamic
shapes, whose split size is ceil(n / chunks)), compared with eager."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import ember_compile, repro

PROGRAMS = {
    "chunk_middle": lambda x: x.chunk(3, dim=-1)[1] * 2,
    "chunk_all": lambda x: [t * (k + 1) for k, t in enumerate(x.chunk(3, dim=-1))],
    "split_rows_last": lambda x: x.split(3, dim=0)[-1] + 1,
}


CASES = [(name, True) for name in PROGRAMS] + [("chunk_all", False)]


@pytest.mark.parametrize("name, dynamic", CASES)
def test_split_matches_eager(name, dynamic):
    fn = PROGRAMS[name]
    compiled = ember_compile(fn, "cpp", dynamic=dynamic)
    for shape in [(4, 48), (7, 50)]:  # 50 = 17 + 17 + 16: the last chunk is shorter
        x = torch.randn(shape)
        got, want = compiled(x), fn(x)
        got, want = (got, want) if isinstance(got, list) else ([got], [want])
        for g, w in zip(got, want):
            assert g.shape == w.shape and torch.equal(g, w), repro(name=name, dynamic=dynamic, shape=shape)
