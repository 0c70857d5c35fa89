"""FlexAttention: the `flex_attention` higher-order op -> one extern whose target the backend builds
into ember's own flash-attention kernel (ir/flex.py says what it computes).

The score_mod and mask_mod GraphModules are traced here into `FlexProgram`s: each ATen call of
theirs maps onto ember's pointwise op set (or a cast, a constant, an element load from a captured
tensor). A function using an op with no mapping, a captured Python scalar or a layout the kernel
does not take makes the call decline (`Unsupported`): it then runs as PyTorch's own op (its
reference implementation on the CPU), with one log line naming the reason, and the rest of the
graph still compiles.

`flex_attention_backward` lowers the same way into ember's backward kernels (dq; dk and dv), with
the gradient through score_mod traced from the joint graph. Where its functions decline (a captured
tensor that needs a gradient, a gradient of the log-sum-exp) it runs as PyTorch's op, an extern
that flattens its nested result, announced the same way; the rest of the backward graph compiles.
"""

from __future__ import annotations

import math

import torch
import torch.fx

from ember import config, log
from ember.aten.registry import Unsupported, lowering
from ember.ir.flex import (
    EXTRA_OPS,
    FlexAttention,
    FlexAttentionBackward,
    FlexBackwardSpec,
    FlexBuffer,
    FlexNode,
    FlexProgram,
    FlexSpec,
)
from ember.ir.ops import POINTWISE

_HOP = getattr(torch.ops.higher_order, "flex_attention", None)
_HOP_BACKWARD = getattr(torch.ops.higher_order, "flex_attention_backward", None)

aten = torch.ops.aten
prims = torch.ops.prims

# ATen op packets -> (ember op, arity of tensor/scalar operands read from args).
_POINTWISE = {
    aten.add: "add",
    aten.sub: "sub",
    aten.mul: "mul",
    aten.div: "truediv",
    aten.neg: "neg",
    aten.abs: "abs",
    aten.exp: "exp",
    aten.exp2: "exp2",
    aten.log: "log",
    aten.log2: "log2",
    aten.sqrt: "sqrt",
    aten.rsqrt: "rsqrt",
    aten.tanh: "tanh",
    aten.sigmoid: "sigmoid",
    aten.sin: "sin",
    aten.cos: "cos",
    aten.pow: "pow",
    aten.floor: "floor",
    aten.ceil: "ceil",
    aten.maximum: "maximum",
    aten.minimum: "minimum",
    aten.eq: "eq",
    aten.ne: "ne",
    aten.lt: "lt",
    aten.le: "le",
    aten.gt: "gt",
    aten.ge: "ge",
    aten.logical_and: "logical_and",
    aten.logical_or: "logical_or",
    aten.logical_not: "logical_not",
    aten.bitwise_and: "bitwise_and",
    aten.bitwise_or: "bitwise_or",
    aten.where: "where",
    aten.floor_divide: "floordiv",
    aten.remainder: "remainder",
}
_CASTS = (aten._to_copy, prims.convert_element_type, aten.to)
_IDENTITY = (aten.clone, aten.lift_fresh_copy, aten.alias, aten.detach)
# Constant-making ops -> the value each makes, or None where an argument gives it.
_CONSTANTS = {
    aten.new_ones: 1,
    aten.new_zeros: 0,
    aten.ones: 1,
    aten.zeros: 0,
    aten.ones_like: 1,
    aten.zeros_like: 0,
    aten.scalar_tensor: None,
    aten.full: None,
    aten.full_like: None,
}


def _work(dtype: torch.dtype, work: torch.dtype) -> torch.dtype:
    """The dtype a value computes in: floats in the attention's working precision."""
    return work if dtype.is_floating_point else dtype


class _Tracer:
    """One score or mask GraphModule -> a FlexProgram; buffers numbered from `first_buffer`."""

    def __init__(
        self, gm: torch.fx.GraphModule, work: torch.dtype, first_arg: int, first_buffer: int, last_arg: int = 4
    ):
        self.gm, self.work, self.last_arg = gm, work, last_arg
        self.first_arg, self.first_buffer = first_arg, first_buffer
        self.nodes: list[FlexNode] = []
        self.keys: dict[tuple, int] = {}
        self.env: dict[torch.fx.Node, int] = {}
        self.buffers: list[FlexBuffer] = []

    def add(self, op: str, inputs: tuple, dtype: torch.dtype, attr=None) -> int:
        key = (op, inputs, dtype, attr if not isinstance(attr, float) or not math.isnan(attr) else "nan")
        if key not in self.keys:
            self.keys[key] = len(self.nodes)
            self.nodes.append(FlexNode(op, inputs, dtype, attr))
        return self.keys[key]

    def dtype(self, i: int) -> torch.dtype:
        return self.nodes[i].dtype

    def cast(self, i: int, dtype: torch.dtype) -> int:
        return i if self.dtype(i) == dtype else self.add("cast", (i,), dtype)

    def operand(self, x, like: torch.dtype | None = None) -> int:
        if isinstance(x, torch.fx.Node):
            slot = self.env[x]
            if slot >= 0:
                return slot
            info = self.buffers[-1 - slot]  # a captured tensor used whole: only a 0-dim one is a value
            if info.ndim != 0:
                raise Unsupported(f"a captured tensor of {info.ndim} dims used without indexing")
            return self.cast(
                self.add("load", (), info.dtype, self.first_buffer - 1 - slot), _work(info.dtype, self.work)
            )
        if isinstance(x, bool):
            return self.add("const", (), torch.bool, x)
        if isinstance(x, int):
            integer = like is not None and not like.is_floating_point and like != torch.bool
            return self.add("const", (), like if integer else torch.int64, x)
        if isinstance(x, float):
            return self.add("const", (), self.work, x)
        raise Unsupported(f"operand {x!r}")

    def run(self) -> FlexProgram:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        fixed = self.last_arg + 1 - self.first_arg
        for k, ph in enumerate(placeholders):
            meta = ph.meta.get("val")
            if not isinstance(meta, torch.Tensor):
                raise Unsupported(f"{ph.name} is a {type(meta).__name__}, not a tensor")
            if k < fixed:
                self.env[ph] = self.add("arg", (), _work(meta.dtype, self.work), self.first_arg + k)
            else:
                self.env[ph] = -1 - len(self.buffers)  # a buffer: only `index` may read it
                self.buffers.append(FlexBuffer(meta.dtype, meta.dim()))
        result = None
        for node in self.gm.graph.nodes:
            if node.op == "call_function":
                self.env[node] = self.call(node)
            elif node.op == "output":
                out = node.args[0]
                if isinstance(out, (list, tuple)):
                    if any(o is not None for o in out[1:]):
                        raise Unsupported("a captured tensor that needs a gradient")
                    out = out[0]
                if not isinstance(out, torch.fx.Node):  # (a gradient that is None: score_mod ignores the score)
                    raise Unsupported(f"a flex_attention function returning {out!r}")
                result = self.env[out]
            elif node.op != "placeholder":
                raise Unsupported(f"{node.op} {node.target} in a flex_attention function")
        if result is None or result < 0:
            raise Unsupported("a flex_attention function returning a captured tensor")
        return FlexProgram(tuple(self.nodes), result)

    def call(self, node: torch.fx.Node) -> int:
        meta = node.meta.get("val")
        if not isinstance(meta, torch.Tensor) or meta.dim() != 0:
            raise Unsupported(f"{node.target} gives {type(meta).__name__} (not a 0-dim tensor) in a flex function")
        dtype = _work(meta.dtype, self.work)
        packet = getattr(node.target, "overloadpacket", None)
        args = node.args
        if packet is aten.index:
            return self.load(args[0], args[1], dtype)
        if packet in _IDENTITY:
            return self.operand(args[0])
        if packet in _CASTS:
            return self.cast(self.operand(args[0]), dtype)
        if packet in _CONSTANTS:
            value = _CONSTANTS[packet]
            if value is None:
                value = args[-1] if packet is aten.full else args[1] if packet is aten.full_like else args[0]
            if not isinstance(value, (bool, int, float)):
                raise Unsupported(f"{node.target} of {value!r}")
            value = bool(value) if dtype == torch.bool else float(value) if dtype.is_floating_point else int(value)
            return self.add("const", (), dtype, value)
        if packet is aten.clamp:
            x = self.cast(self.operand(args[0]), dtype)
            lo = args[1] if len(args) > 1 else node.kwargs.get("min")
            hi = args[2] if len(args) > 2 else node.kwargs.get("max")
            if lo is not None:
                x = self.add("maximum", (x, self.cast(self.operand(lo, dtype), dtype)), dtype)
            if hi is not None:
                x = self.add("minimum", (x, self.cast(self.operand(hi, dtype), dtype)), dtype)
            return x
        if packet is aten.div and node.kwargs.get("rounding_mode") is not None:
            if node.kwargs["rounding_mode"] != "floor" or dtype.is_floating_point:
                raise Unsupported(f"div with rounding_mode={node.kwargs['rounding_mode']!r}")
            packet = aten.floor_divide
        name = _POINTWISE.get(packet)
        if name in ("bitwise_and", "bitwise_or") and dtype == torch.bool:
            name = "logical_and" if name == "bitwise_and" else "logical_or"  # `&` of two masks
        if name is None:
            raise Unsupported(f"{node.target} in a flex_attention function")
        if packet in (aten.add, aten.sub) and node.kwargs.get("alpha", 1) != 1:
            raise Unsupported(f"{node.target} with alpha")
        if set(node.kwargs) - {"alpha"}:
            raise Unsupported(f"{node.target} with {sorted(node.kwargs)}")
        arity = EXTRA_OPS.get(name) or POINTWISE[name].arity
        if len(args) != arity:
            raise Unsupported(f"{node.target} with {len(args)} operands")
        operands = [self.operand(a, dtype) for a in args]
        kind = POINTWISE[name].kind if name in POINTWISE else "arith"
        if kind == "compare" and name not in ("logical_and", "logical_or", "logical_not"):
            common = _promote([self.dtype(o) for o in operands], args)
            operands = [self.cast(o, common) for o in operands]
        elif kind == "select":
            operands = [self.cast(operands[0], torch.bool)] + [self.cast(o, dtype) for o in operands[1:]]
        elif kind == "arith":
            operands = [self.cast(o, dtype) for o in operands]
        return self.add(name, tuple(operands), dtype)

    def load(self, buffer, indices, dtype: torch.dtype) -> int:
        slot = self.env.get(buffer) if isinstance(buffer, torch.fx.Node) else None
        if slot is None or slot >= 0:
            raise Unsupported("index into something other than a captured tensor")
        number = -1 - slot
        info = self.buffers[number]
        if len(indices) != info.ndim or any(i is None for i in indices):
            raise Unsupported("a captured tensor indexed by fewer indices than its dims")
        # 32-bit index math, as a [BLOCK_M, BLOCK_N] tile of 64-bit indices costs a GPU kernel half its
        # registers; the kernel refuses a captured tensor of 2**31 elements or more.
        idx = tuple(self.cast(self.operand(i), torch.int32) for i in indices)
        loaded = self.add("load", idx, info.dtype, self.first_buffer + number)
        return self.cast(loaded, dtype)


def _promote(dtypes: list[torch.dtype], args) -> torch.dtype:
    tensors = [d for d, a in zip(dtypes, args) if isinstance(a, torch.fx.Node)]
    result = tensors[0] if tensors else dtypes[0]
    for d in tensors[1:]:
        result = torch.promote_types(result, d)
    if any(isinstance(a, float) for a in args) and not result.is_floating_point:
        result = dtypes[[isinstance(a, float) for a in args].index(True)]
    return result


def _tensor_meta(node) -> torch.Tensor:
    meta = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(meta, torch.Tensor):
        raise Unsupported(f"flex_attention operand {node!r} is not a tensor")
    return meta


def _lower_flex(b, node: torch.fx.Node):
    try:
        return _build(b, node)
    except Unsupported as e:
        log.warn(f"ember: flex_attention runs as PyTorch's op (its reference implementation on the CPU): {e}")
        raise


def _build(b, node: torch.fx.Node):
    query, key, value, score_gm, block_mask, scale, _options, score_bufs, mask_bufs = (list(node.args) + [(), ()])[:9]
    spec, operands = _spec(b, query, key, value, score_gm, block_mask, scale, score_bufs, mask_bufs)
    args = tuple(b.arg(x) for x in operands)
    log.summary(f"{spec.describe()} compiles into ember's flash-attention kernel")
    return b.extern_call(FlexAttention(spec), args, {}, node.meta.get("val"), origin="flex_attention")


def _spec(b, query, key, value, score_gm, block_mask, scale, score_bufs, mask_bufs) -> tuple[FlexSpec, list]:
    """The forward's spec, and the extern's operands: q, k, v, the BlockMask's kv tensors, buffers."""
    q, k, v = (_tensor_meta(x) for x in (query, key, value))
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise Unsupported("query, key and value of 4 dims")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (
        torch.float32,
        torch.float64,
        torch.bfloat16,
        torch.float16,
    ):
        raise Unsupported(f"dtypes {q.dtype}, {k.dtype}, {v.dtype}")
    if q.device != b.graph.device:
        raise Unsupported(f"device {q.device}")
    if q.device.type == "cpu" and q.dtype == torch.float16:
        raise Unsupported("float16 on the CPU")
    if not all(isinstance(s, int) for s in (q.shape[1], k.shape[1], q.shape[3], k.shape[3], v.shape[3])):
        raise Unsupported("symbolic head counts or head sizes")
    if q.shape[1] % k.shape[1] or k.shape[3] != q.shape[3]:
        raise Unsupported("query heads not a multiple of key heads, or key's head size not query's")
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    score_gm, mask_gm = b.arg(score_gm), b.arg(block_mask[-1])
    kv_num, kv_idx, full_num, full_idx = block_mask[2:6]
    q_block, kv_block = block_mask[-3], block_mask[-2]
    symbolic = [
        isinstance(s, torch.fx.Node) and isinstance(s.meta.get("val"), torch.SymInt) for s in (q_block, kv_block)
    ]
    if not all(sym or (isinstance(s, int) and s > 0) for s, sym in zip((q_block, kv_block), symbolic)):
        raise Unsupported(f"BlockMask block sizes {q_block}, {kv_block}")
    sizes_at_run_time = any(symbolic)  # (dynamic=True makes them symbols): the kernel reads them per call
    if q.device.type == "cuda" or config.get("backend") == "triton":
        # Triton's tiles are fixed when the kernel compiles and must divide the BlockMask's blocks, at 16
        # rows and columns at least (its dot's smallest): sizes known only at run time could break that.
        if sizes_at_run_time:
            raise Unsupported("BlockMask block sizes that vary between calls (dynamic shapes) on Triton")
        if min(q_block & -q_block, kv_block & -kv_block) < 16:
            raise Unsupported(f"BlockMask blocks of {q_block} x {kv_block}: Triton tiles dividing them are below 16")
    buffers = []
    for buf in (*score_bufs, *mask_bufs):
        if not isinstance(buf, torch.fx.Node) or not isinstance(buf.meta.get("val"), torch.Tensor):
            raise Unsupported(f"a captured {type(buf).__name__} (only tensors)")
        if _tensor_meta(buf).device != q.device:
            raise Unsupported("a captured tensor on another device")
    programs = []
    for gm, first_arg, n_bufs in ((score_gm, 0, len(score_bufs)), (mask_gm, 1, len(mask_bufs))):
        if not isinstance(gm, torch.fx.GraphModule):
            raise Unsupported(f"a {type(gm).__name__} as a flex_attention function")
        tracer = _Tracer(gm, work, first_arg, len(buffers))
        program = tracer.run()
        if len(tracer.buffers) != n_bufs:
            raise Unsupported("captured tensors not matching the function's inputs")
        buffers += tracer.buffers
        programs.append(program)
    score, mask = programs
    if score.nodes[score.result] == FlexNode("arg", (), work, 0):
        score = None
    if mask.constant() is not None:
        if not mask.constant():
            raise Unsupported("a mask_mod that masks everything")
        mask = None
    if not all(isinstance(x, torch.fx.Node) for x in (kv_num, kv_idx)):
        raise Unsupported("a BlockMask without kv blocks")
    has_full = isinstance(full_num, torch.fx.Node) and isinstance(full_idx, torch.fx.Node)
    spec = FlexSpec(
        dtype=q.dtype,
        work_dtype=work,
        head_dim=int(q.shape[3]),
        value_dim=int(v.shape[3]),
        scale=float(scale) if scale is not None else 1.0 / math.sqrt(q.shape[3]),
        score=score,
        mask=mask,
        buffers=tuple(buffers),
        q_block=0 if sizes_at_run_time else q_block,
        kv_block=0 if sizes_at_run_time else kv_block,
        has_full_blocks=has_full,
    )
    for t in (kv_num, kv_idx, *((full_num, full_idx) if has_full else ())):
        meta = _tensor_meta(t)
        if meta.dtype not in (torch.int32, torch.int64) or meta.device != q.device:
            raise Unsupported(f"BlockMask tensors of {meta.dtype} on {meta.device}")
    operands = [query, key, value, kv_num, kv_idx, *((full_num, full_idx) if has_full else ()), *score_bufs, *mask_bufs]
    if sizes_at_run_time:
        operands += [q_block, kv_block]
    return spec, operands


def _lower_flex_backward(b, node: torch.fx.Node):
    meta = node.meta.get("val")
    if not isinstance(meta, (tuple, list)) or len(meta) != 4 or not isinstance(meta[3], (tuple, list)):
        raise Unsupported("flex_attention_backward of an unknown result structure")
    try:
        spec = _backward_spec(b, node)
    except Unsupported as e:
        spec = None
        log.warn(f"ember: flex_attention_backward runs as PyTorch's op: {e}")
    flat = (*meta[:3], *meta[3])
    target = FlexAttentionBackward(spec, _HOP_BACKWARD)
    results = b.extern_call(target, b.arg(node.args), {}, flat, origin="flex_attention_backward")
    return (*results[:3], tuple(results[3:]))


def _backward_spec(b, node: torch.fx.Node) -> FlexBackwardSpec:
    args = list(node.args) + [(), ()]
    query, key, value, _out, _lse, _grad_out, grad_lse, fw_gm, joint_gm, block_mask, scale = args[:11]
    score_bufs, mask_bufs = args[12], args[13]
    if grad_lse is not None:
        raise Unsupported("a gradient of the log-sum-exp")
    if len(block_mask) < 13 or not all(isinstance(t, torch.fx.Node) for t in block_mask[6:8]):
        raise Unsupported("a BlockMask without its query blocks")
    spec, _ = _spec(b, query, key, value, fw_gm, block_mask, scale, score_bufs, mask_bufs)
    q, k = _tensor_meta(query), _tensor_meta(key)
    if k.shape[0] != q.shape[0]:
        raise Unsupported("keys broadcast over the batch")
    if spec.dtype == torch.float64:
        raise Unsupported("float64")
    joint = b.arg(joint_gm)
    if not isinstance(joint, torch.fx.GraphModule):
        raise Unsupported(f"a {type(joint).__name__} as the joint graph")
    tracer = _Tracer(joint, spec.work_dtype, 0, 0, last_arg=5)
    grad = tracer.run()
    if len(tracer.buffers) != len(score_bufs):
        raise Unsupported("captured tensors not matching the joint graph's inputs")
    if grad.nodes[grad.result] == FlexNode("arg", (), spec.work_dtype, 5):
        grad = None  # d score_mod / d score = 1 (a bias)
    return FlexBackwardSpec(spec, grad)


if _HOP is not None:
    lowering(_HOP)(_lower_flex)
if _HOP_BACKWARD is not None:
    lowering(_HOP_BACKWARD)(_lower_flex_backward)
