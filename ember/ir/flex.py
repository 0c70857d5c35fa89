"""FlexAttention as ember sees it: the score and mask functions as small expression programs, and
the record of one attention call that the code generators render into a flash-attention kernel.

`torch.nn.attention.flex_attention` reaches ATen as the `flex_attention` higher-order op, with
its `score_mod(score, b, h, q_idx, kv_idx, *buffers)` and `mask_mod(b, h, q_idx, kv_idx,
*buffers)` traced into GraphModules over 0-dim tensors. The lowering (aten/lowerings/flex.py)
turns each into a `FlexProgram`: SSA nodes over five arguments (0 score, 1 b, 2 h, 3 q_idx,
4 kv_idx), constants, element loads from captured buffers, casts and ember's pointwise ops
(ir/ops.py, whose renderings the kernels use). The kernel evaluates the program on a whole
tile, the indices broadcast along their dims.

Semantics (eager's `math_attention`, and Inductor's kernel):
    s = (q . k) * scale;  s = score_mod(s, ...);  s = -inf where not mask_mod(...) or outside the
    BlockMask's listed blocks (blocks listed as full skip mask_mod);  out = softmax(s) @ v
    (0 for a row with no finite score);  lse = logsumexp(s) / ln 2 and max = max(s) / ln 2
    (the op returns both in base 2; -inf for an empty row).
Floating scores and buffer values compute in `FlexSpec.work_dtype` (fp32, fp64 for fp64 inputs)
whatever the traced dtype, as eager's reference does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# The arguments of a score program; a mask program uses 1-4; the score's gradient program (the joint
# graph's first output) 0-5, 5 being the gradient of score_mod's result.
ARG_NAMES = ("score", "b", "h", "q_idx", "kv_idx", "grad")
# Ops a program may use beyond ir/ops.py's pointwise table, rendered by each code generator.
EXTRA_OPS = {"floordiv": 2, "remainder": 2}


@dataclass(frozen=True)
class FlexNode:
    """One SSA node. op: "arg" (attr: the argument's number), "const" (attr: the value), "load"
    (attr: the buffer's number; inputs: one index per buffer dim), "cast" (to `dtype`), or a
    pointwise op (ir/ops.py) or one of EXTRA_OPS over `inputs` (node numbers)."""

    op: str
    inputs: tuple[int, ...]
    dtype: torch.dtype
    attr: object = None


@dataclass(frozen=True)
class FlexProgram:
    nodes: tuple[FlexNode, ...]
    result: int

    def uses(self, arg: int) -> bool:
        return any(n.op == "arg" and n.attr == arg for n in self.nodes)

    def invariant(self, args: set[int]) -> list[bool]:
        """Per node: whether its value depends only on the arguments `args` and constants."""
        out: list[bool] = []
        for n in self.nodes:
            out.append(n.attr in args if n.op == "arg" else all(out[j] for j in n.inputs))
        return out

    def gathers(self, args: set[int]) -> bool:
        """Whether it reads a captured tensor at positions that vary with more than `args` (a bias table
        read by relative position: a load per score)."""
        fixed = self.invariant(args)
        return any(n.op == "load" and not f for n, f in zip(self.nodes, fixed))

    def constant(self) -> object | None:
        """The result's value where the program is a constant (mask_mod of no mask: True), else None."""
        node = self.nodes[self.result]
        return node.attr if node.op == "const" else None


@dataclass(frozen=True)
class FlexBuffer:
    """A captured tensor a program reads (a bias table, document ids): its dtype and rank. Its
    strides are read at run time."""

    dtype: torch.dtype
    ndim: int


@dataclass(frozen=True)
class FlexSpec:
    """What a flash-attention kernel for one call is made from; sizes and strides are run-time."""

    dtype: torch.dtype  # q, k, v and out
    work_dtype: torch.dtype  # what scores compute in
    head_dim: int  # D of q and k
    value_dim: int  # D of v and out
    scale: float
    score: FlexProgram | None  # None: the score is kept as it is
    mask: FlexProgram | None  # None: no mask_mod (every element of a listed block is kept)
    buffers: tuple[FlexBuffer, ...]  # the score program's captured tensors, then the mask program's
    q_block: int  # the BlockMask's block sizes; 0: sizes only known at run time (passed after the buffers)
    kv_block: int
    has_full_blocks: bool  # the BlockMask lists full blocks apart (mask_mod is skipped there)

    def describe(self) -> str:
        parts = [f"d={self.head_dim}", str(self.dtype).replace("torch.", "")]
        if self.score is not None:
            parts.append("score_mod")
        if self.mask is not None:
            parts.append("mask_mod")
        if self.buffers:
            parts.append(f"{len(self.buffers)} captured")
        return "flex_attention " + " ".join(parts)


@dataclass(frozen=True)
class FlexBackwardSpec:
    """flex_attention_backward's kernels: the forward's spec, and the program giving the gradient of
    the score before score_mod from the one after it (None: score_mod's derivative is 1)."""

    forward: FlexSpec
    grad: FlexProgram | None

    def describe(self) -> str:
        return self.forward.describe().replace("flex_attention", "flex_attention_backward", 1)


class FlexAttention:
    """The extern target of a `flex_attention` call until the backend builds its kernel
    (backends/flex.py replaces it with a callable of the kernel). Arguments at run time:
    q, k, v, kv_num_blocks, kv_indices, [full_kv_num_blocks, full_kv_indices], *buffers,
    [q_block, kv_block] where the spec's are 0. Results: out, lse, max (base 2), in the op's layouts."""

    fresh_result = True

    def __init__(self, spec: FlexSpec):
        self.spec = spec
        self.__name__ = "flex_attention"

    def __call__(self, *args):
        raise RuntimeError("flex_attention's kernel was not built (the backend builds it before the first call)")

    def __repr__(self) -> str:
        return self.spec.describe()


class FlexAttentionBackward:
    """The extern target of a `flex_attention_backward` call: PyTorch's op (its reference
    implementation) until the backend builds ember's kernels for it (backends/flex.py), which it does
    where the code generator has them (Triton). Called with the op's own arguments; returns dq, dk,
    dv and the captured tensors' gradients (None: none of them needs one), flattened."""

    fresh_result = True

    def __init__(self, spec: FlexBackwardSpec | None, reference):
        self.spec, self.reference = spec, reference
        self.__name__ = "flex_attention_backward"

    def __call__(self, *args):
        dq, dk, dv, grads = self.reference(*args)
        return (dq, dk, dv, *grads)


__all__ = [
    "ARG_NAMES",
    "EXTRA_OPS",
    "FlexAttention",
    "FlexAttentionBackward",
    "FlexBackwardSpec",
    "FlexBuffer",
    "FlexNode",
    "FlexProgram",
    "FlexSpec",
]
