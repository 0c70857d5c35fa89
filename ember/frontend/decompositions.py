"""The decomposition table ember hands to AOTAutograd.

Composite ops that ember fuses well (softmax, layer_norm, gelu and their backward
formulas) are broken into pointwise ops and reductions that the importer lowers, so that
the scheduler can fuse them. Ops that are better served by a library (matmul, convolution,
SDPA, embedding) are *not* decomposed: they reach the importer intact and run as externs.
Foreach ops (foreach.py) become their per-tensor ops.
"""

from __future__ import annotations

import functools
import sys

import torch
from torch._decomp import get_decompositions

from ember import faults
from ember.frontend.foreach import foreach_decompositions

aten = torch.ops.aten

_DECOMPOSE = [
    aten._softmax,
    aten._safe_softmax,  # SDPA's math path (a masked row of -inf gives 0s): softmax + any(-inf) fused
    aten._log_softmax,
    aten._softmax_backward_data,
    aten._log_softmax_backward_data,
    aten.native_layer_norm,
    aten.native_layer_norm_backward,
    # batch norm: at inference one pointwise scale-and-shift that fuses with the ReLU and
    # residual add around it; in training its statistics are reductions over N, H, W.
    aten._native_batch_norm_legit_no_training,
    aten._native_batch_norm_legit,
    aten._native_batch_norm_legit_functional,
    aten.native_batch_norm,
    aten.native_batch_norm_backward,
    aten.gelu,
    aten.gelu_backward,
    aten.silu,
    aten.silu_backward,
    aten.sigmoid_backward,
    aten.tanh_backward,
    aten.threshold_backward,
    aten.hardtanh,
    aten.hardtanh_backward,
    aten.leaky_relu,
    aten.leaky_relu_backward,
    aten.elu,
    aten.elu_backward,
    aten.nll_loss_forward,  # gather/scatter of the target class: lowered as one-hot selections
    aten.nll_loss_backward,
    aten.mse_loss,
    aten.mse_loss_backward,
    aten.addcmul,
    aten.addcdiv,
    aten.lerp,
    aten.rsub,
    aten.masked_fill,
    aten.clamp_min,
    aten.clamp_max,
    aten.full_like,
    aten.zeros_like,
    aten.ones_like,
    aten.new_zeros,
    aten.new_ones,
    aten.new_full,
    aten.zeros,
    aten.ones,
    aten.square,
    aten.std,
    aten.std_mean,
    aten.linalg_vector_norm,
    aten.native_dropout_backward,
    aten.expand_as,
    aten.mv,
    aten.dot,
    aten.transpose,
]


def decomposition_table() -> dict:
    """The table AOTAutograd traces with. The setting `fault_inject=decompose=OP` (a testing aid)
    makes aten.OP's decomposition raise."""
    # Dynamo writes `x.addcmul_(a, b, value=v)` (single-tensor Adam) as Inductor's `prims.fma`, an op that
    # exists once torch._inductor.inductor_prims is imported (a second's import, which Dynamo makes when
    # it emits the op): from then on it is decomposed too.
    table = _table("torch._inductor.inductor_prims" in sys.modules)
    op = faults.armed("decompose")
    if op is None:
        return table
    return {**table, getattr(torch.ops.aten, op).default: _injected_fault}


@functools.lru_cache(maxsize=2)
def _table(with_fma: bool) -> dict:
    # Foreach ops (an optimizer's step) become one pointwise op per tensor, which fuse.
    table = {**get_decompositions(_DECOMPOSE), **foreach_decompositions()}
    if with_fma:
        table[torch.ops.prims.fma.default] = _fma
    return table


def _fma(a, b, c):
    return a * b + c


def _injected_fault(*args, **kwargs):
    raise TypeError("fault injected at 'decompose' (setting fault_inject)")
