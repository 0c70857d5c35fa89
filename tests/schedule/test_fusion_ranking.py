"""Fusion re-ranks only the candidate pairs near each merge (schedule/fusion.py: _near_merge): the
schedule must be exactly the one that re-ranking every pair after every merge gives (the setting
fusion_rank_every_pair), on training graphs with residuals, batch norms, split reductions and siblings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import SCALE, explain_strict, make_workload


class ConvBlocks(nn.Module):
    """Two residual conv / batch norm / ReLU blocks, channels-last, and a linear head."""

    def __init__(self, c: int = 8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU()) for _ in range(2)
        )
        self.head = nn.Linear(c, 10)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = torch.relu(block(x) + x)
        return self.head(x.mean((2, 3)))


def _fingerprint(report) -> list:
    out = []
    for g in report.graphs:
        assert g.fallback is None, g.fallback
        out.append((g.kind, [(k.name, k.domain, k.source) for k in g.kernels], [str(f) for f in g.fusion], g.memory))
    return out


def _cases(backend: str):
    model, inputs = make_workload("gpt2_block", SCALE[backend], torch.float32)
    yield "gpt2_block", model, [x.requires_grad_() for x in inputs]
    conv = ConvBlocks().to(memory_format=torch.channels_last)
    yield "conv_blocks", conv, [torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last).requires_grad_()]


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_ranking_near_each_merge_matches_ranking_every_pair(backend):
    for name, model, inputs in _cases(backend):
        # schedule_cache off: both rankings must schedule, not load
        near = _fingerprint(explain_strict(model, *inputs, backend=backend, schedule_cache=False))
        every = _fingerprint(
            explain_strict(model, *inputs, backend=backend, schedule_cache=False, fusion_rank_every_pair=True)
        )
        assert [g[0] for g in near] == ["forward", "backward"], name
        assert near == every, name
