"""The GEMM tuning stage of the Triton backend (backends/gemm_tuning.py): the tiles it would time,
ordered by the target's SM count, and what it chooses where it cannot measure."""

from __future__ import annotations

import pytest
import torch

from ember import config
from ember.backends.gemm_tuning import GemmTuning, candidates, fit_config
from ember.backends.triton import TritonBackend
from ember.schedule.gemm import GemmProblem

BIG = GemmProblem(1, 8192, 4096, 4096, torch.bfloat16, "row", "col", "cuda:0")
SMALL = GemmProblem(1, 40, 24, 20, torch.float32, "row", "row", "cuda:0")


def _no_loading(source: str):
    raise AssertionError("nothing is compiled where nothing is measured")


def test_tiles_are_pruned_by_shape():
    tiles = candidates(BIG, 132)
    assert 1 <= len(tiles) <= 6 and tiles[0].block_m * tiles[0].block_n == 128 * 256
    assert all(t.block_m <= 64 and t.block_n <= 32 and t.block_k == 32 for t in candidates(SMALL, 132))
    assert fit_config(SMALL).block_m == 64
    assert BIG.shape_class() == GemmProblem(1, 5000, 4096, 4096, torch.bfloat16, "row", "col", "x").shape_class()


def test_tiles_leaving_sms_idle_come_last_by_the_targets_count():
    # [1024, 1024]: a 128x256 tile makes 32 programs, a 64x64 one 256. With 132 SMs the tiles of
    # fewer than 132 programs go last; with 16 SMs every tile fills the GPU and the size order stays.
    p = GemmProblem(1, 1024, 1024, 1024, torch.bfloat16, "row", "row", "cuda:0")

    def programs(t):
        return -(-p.m // t.block_m) * -(-p.n // t.block_n)

    many = candidates(p, 132)
    assert [programs(t) >= 132 for t in many] == sorted((programs(t) >= 132 for t in many), reverse=True)
    assert programs(many[0]) >= 132
    assert programs(candidates(p, 16)[0]) < 132  # the largest tile first, as listed


@pytest.mark.parametrize("mode,template", [("aten", False), ("auto", False), ("template", True)])
def test_without_a_gpu_nothing_is_measured(mode, template):
    target = TritonBackend().target()  # Triton's CPU interpreter
    assert target.interpreted
    tuning = GemmTuning(target, None, _no_loading)
    with config.override(gemm=mode):
        choice = tuning.choose(BIG, 0)
    assert choice.template == template, choice.reason
    # An interpreted target on a CUDA device measures nothing either.
    with config.override(gemm=mode):
        assert GemmTuning(target, torch.device("cuda", 0), _no_loading).choose(BIG, 0).template == template


def test_the_tiles_to_time_are_rendered_and_compute_the_product():
    """The kernels `measure` times on a GPU, built by the graph's own schedule and codegen path, rendered
    for the backend's target and run here through Triton's interpreter against torch.mm."""
    from ember.backends.gemm_tuning import bare_kernels, grid
    from ember.codegen.triton import PRELUDE

    backend = TritonBackend()
    target = backend.target()
    p = GemmProblem(1, 16, 24, 20, torch.float32, "row", "row", "cpu")
    a, b = torch.randn(p.m, p.k), torch.randn(p.k, p.n)
    sources = bare_kernels(p, a, b, candidates(p, target.sm_count)[:2], target)
    module = backend._load("\n\n".join([PRELUDE] + [s.source for s in sources]) + "\n")
    for src in sources:
        out = torch.full((p.m, p.n), float("nan"))
        sizes = [int(s) for s in src.sizes()]
        getattr(module, src.kernel.name)[grid(p, src.config)](a, b, out, *sizes, **src.constants())
        torch.testing.assert_close(out, a @ b, rtol=1e-4, atol=1e-4)
