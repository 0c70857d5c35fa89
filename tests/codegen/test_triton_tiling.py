"""How the Triton backend tiles reductions: column sums (memory contiguous along the kept dim)
are tiled across rows, whatever the kernel's other loads and however the split indexes its rows;
rows contiguous along the reduced dim stay persistent."""

from __future__ import annotations

import torch

from ember.codegen.triton import launch_config
from ember.schedule.split import split_reductions
from tests.schedule.test_fusion import G

BF16 = torch.bfloat16


def _cast(b: G, x, dtype=torch.float32):
    return b.g.add("cast", [x], {"dtype": dtype}, [(x.shape, dtype, None)], origin="_to_copy").out


def _split_and_schedule(b: G, out):
    b.g.outputs = [out]
    assert split_reductions(b.g) == 1
    return b.schedule(*b.g.outputs).kernels


def _big_reader(sched_kernels, big):
    (k,) = [k for k in sched_kernels if big in k.reads]
    return k


def test_layer_norm_weight_gradient_is_tiled_across_rows():
    # sum over rows of (x - mean) * rstd * grad: the row statistics vary along the rows only and
    # must not outvote the two [rows, 768] inputs.
    b = G()
    x, grad = b.input(8192, 768, dtype=BF16), b.input(8192, 768, dtype=BF16)
    mean, rstd = b.input(8192, 1), b.input(8192, 1)
    xf, gf = _cast(b, x), _cast(b, grad)
    dw = b.reduce("sum", b.pw("mul", b.pw("mul", b.pw("sub", xf, mean), rstd), gf), (0,))
    k = _big_reader(_split_and_schedule(b, dw), x)
    cfg = launch_config(k)
    assert not cfg.persistent and (cfg.xblock, cfg.rblock, cfg.num_warps) == (64, 32, 4)  # 128-byte bf16 rows


def test_bias_gradient_split_across_two_dims_is_tiled_across_rows():
    # [16, 1024, 3072] summed over (0, 1): the split chunk spans the two dims, so its row index is
    # `r % 1024`, which has no coefficient of r; it still varies along r.
    b = G()
    g = b.input(16, 1024, 3072, dtype=BF16)
    db = b.reduce("sum", _cast(b, g), (0, 1))
    k = _big_reader(_split_and_schedule(b, db), g)
    cfg = launch_config(k)
    assert not cfg.persistent and (cfg.xblock, cfg.rblock, cfg.num_warps) == (64, 128, 8)  # one tile input


def test_row_reduction_stays_persistent():
    b = G()
    x, w = b.input(4096, 768), b.input(768)
    y = b.pw("mul", b.pw("sub", x, b.reduce("max", x, (1,), keepdim=True)), w)
    (k,) = b.schedule(y).kernels
    cfg = launch_config(k)
    assert cfg.persistent and cfg.rblock == 1024
