"""The graph builder that lowerings write with: FX arguments in, ember nodes out.

The importer (importer.py) owns one builder per graph, binds each FX node's result in it, and
hands it to the node's lowering (registry.py). A lowering reads its arguments (`arg`), the
node's output meta (`out_meta`), and adds values: `pointwise`, `cast`, `reduce`, `view`,
`reshape`, `full`, `iota`, or an ATen call (`extern_call`). Every check that makes a value a
kernel operand (a kernel dtype, the graph's device) lives here, and declines with `Unsupported`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from ember.aten.registry import GraphUnsupported, Unsupported
from ember.ir import dtypes, ops
from ember.ir.graph import Graph, Value
from ember.ir.sizes import Expr, as_expr, product
from ember.ir.views import VIEW_KINDS
from ember.target import LowerHeuristics


class ShapeDtype:
    """The output meta of a value a lowering makes itself (not read off an FX node)."""

    def __init__(self, shape, dtype):
        self.shape = shape
        self.dtype = dtype


class GraphBuilder:
    """Adds ember nodes to one Graph on behalf of the FX node being lowered (`current`)."""

    def __init__(self, graph: Graph, lower: LowerHeuristics | None = None):
        self.graph = graph
        # Which ops the target computes itself rather than calling a library (a lowering declines otherwise).
        self.lower = lower or LowerHeuristics()
        # Each FX node's result: a Value, a size expression, a Python scalar, or a tuple of them.
        self.env: dict[torch.fx.Node, Any] = {}
        self._current: torch.fx.Node | None = None
        # Floats computed from sizes (SymFloat), held as 0-d float64 values (importer: _sym_float).
        self.sym_floats: set[Value] = set()
        # compile_subgraph(gm, what) -> a callable taking a list of inputs: how a higher-order op's
        # branch or loop body becomes its own compiled graph (the pipeline passes it; this layer
        # cannot import the pipeline). None: such ops run as ATen calls.
        self.compile_subgraph: Callable[[torch.fx.GraphModule, str], Callable] | None = None
        self._on_device: dict[Value, Value] = {}  # each CPU scalar's one copy to the device

    @property
    def device(self) -> torch.device:
        return self.graph.device

    @property
    def current(self) -> torch.fx.Node | None:
        return self._current

    @current.setter
    def current(self, node: torch.fx.Node | None) -> None:
        """The FX node being lowered; the nodes added for it carry its name."""
        self._current = node
        self.graph.current_fx_node = node.name if node is not None else ""

    @property
    def origin(self) -> str:
        """The name of the op being lowered, recorded on the nodes it adds."""
        return op_name(self.current.target) if self.current is not None else ""

    # -- reading arguments ----------------------------------------------------------------
    def arg(self, x) -> Any:
        """An FX argument as an IR operand: Value, sympy expression, or Python scalar."""
        if isinstance(x, torch.fx.Node):
            return self.env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(self.arg(a) for a in x)
        return x

    def out_meta(self) -> torch.Tensor:
        """The current node's output meta, which must be a tensor a kernel can compute."""
        val = node_meta(self.current)
        if not isinstance(val, torch.Tensor):
            raise Unsupported("non-tensor output")
        self.check_kernel_tensor(val)
        return val

    def check_kernel_tensor(self, t) -> None:
        if t.dtype not in dtypes.KERNEL_DTYPES:
            raise Unsupported(f"dtype {t.dtype}")
        if t.device != self.graph.device:
            raise Unsupported(f"device {t.device}")

    def operand(self, x) -> Any:
        """A kernel operand: a Value on the graph's device with a kernel dtype, or a scalar. A CPU
        scalar tensor in a device graph is copied to the device once, as eager allows it beside
        device tensors."""
        if isinstance(x, Value):
            if x.device != self.graph.device and x.device.type == "cpu" and not x.shape:
                x = self.to_device(x)
            self.check_kernel_tensor(x)
            return x
        if isinstance(x, (bool, int, float, Expr)):
            return x
        raise Unsupported(f"operand {type(x).__name__}")

    def to_device(self, x: Value, origin: str = "to device") -> Value:
        """`x`, a CPU scalar tensor, copied to the graph's device: one copy however many kernels read it."""
        copied = self._on_device.get(x)
        if copied is None:
            meta = torch.empty((), dtype=x.dtype, device="meta")
            copied = self._on_device[x] = self.extern_call(ToDevice(self.graph.device), (x,), {}, meta, origin=origin)
        return copied

    def is_sym_float(self, x) -> bool:
        return isinstance(x, Value) and x in self.sym_floats

    # -- adding values --------------------------------------------------------------------
    def pointwise(self, fn: str, operands, out: torch.Tensor | ShapeDtype | None = None, **attrs) -> Value:
        out = self.out_meta() if out is None else out
        operands = [self.operand(x) for x in operands]
        values = [x for x in operands if isinstance(x, Value)]
        if fn in ops.FLOAT_ONLY and not out.dtype.is_floating_point:
            raise Unsupported(f"{fn} on {out.dtype}")
        if ops.POINTWISE[fn].kind == "compare":
            attrs["operand_dtype"] = _promoted(operands)
        shape = tuple(as_expr(s) for s in out.shape)
        for v in values:
            if len(v.shape) > len(shape):
                raise Unsupported("operand rank above output rank")
        node = self.graph.add("pointwise", operands, {"fn": fn, **attrs}, [(shape, out.dtype, None)], self.origin)
        return node.out

    def cast(self, x: Value, dtype: torch.dtype) -> Value:
        if dtype not in dtypes.KERNEL_DTYPES:
            raise Unsupported(f"cast to {dtype}")
        if x.dtype == dtype:
            return x
        return self.graph.add("cast", [self.operand(x)], {"dtype": dtype}, [(x.shape, dtype, None)], self.origin).out

    def reduce(self, kind: str, x: Value, dims, keepdim: bool, dtype: torch.dtype) -> Value:
        x = self.operand(x)
        rank = len(x.shape)
        if rank == 0:  # dims may name 0 or -1 of a 0-d tensor: the reduction is a copy
            return (
                self.cast(x, dtype) if x.dtype != dtype else self.pointwise("add", [x, 0], ShapeDtype(x.shape, dtype))
            )
        dims = tuple(sorted({d % rank for d in dims})) if dims else tuple(range(rank))
        if any(x.shape[d] == 0 for d in dims):
            raise Unsupported("reduction over an empty dimension")
        shape = tuple((1 if keepdim else None) if k in dims else s for k, s in enumerate(x.shape))
        shape = tuple(as_expr(s) for s in shape if s is not None)
        node = self.graph.add(
            "reduce", [x], {"kind": kind, "dims": dims, "keepdim": keepdim}, [(shape, dtype, None)], self.origin
        )
        return node.out

    def view(self, kind: str, base: Value, **attrs) -> Value:
        base = self.operand(base)
        shape = tuple(as_expr(s) for s in VIEW_KINDS[kind].shape(base.shape, attrs))
        return self.graph.add("view", [base], {"kind": kind, **attrs}, [(shape, base.dtype, None)], self.origin).out

    def reshape(self, base: Value, shape) -> Value:
        shape = tuple(as_expr(s) for s in shape)
        if shape == base.shape:
            return base
        if -1 in [int(s) if s.is_Integer else 0 for s in shape]:
            known = product(s for s in shape if s != -1)
            shape = tuple(product(base.shape) / known if s == -1 else s for s in shape)
        return self.view("reshape", base, shape=shape)

    def full(self, value, shape, dtype: torch.dtype, origin: str | None = None) -> Value:
        """A value of `shape` filled with `value` (a number or a size expression), never stored."""
        shape = tuple(as_expr(s) for s in shape)
        return self.graph.add("full", [], {"value": value}, [(shape, dtype, None)], origin or self.origin).out

    def iota(self, length) -> Value:
        """0, 1, ..., length - 1 as int64 (positions along a dim), never stored."""
        attrs = {"start": 0, "step": 1}
        return self.graph.add("iota", [], attrs, [((as_expr(length),), torch.int64, None)], self.origin).out

    def numel(self, x: Value, dims) -> Expr:
        return product(x.shape[d] for d in dims) if dims else product(x.shape)

    def extern_call(self, target, args, kwargs, meta, origin: str) -> Any:
        """An ATen call (or any callable) at run time: `meta` gives its results' shapes, dtypes and
        strides; the Values among args and kwargs become its inputs."""
        metas = list(meta) if isinstance(meta, (list, tuple)) else [meta]
        out_types = []
        for m in metas:
            if isinstance(m, torch.Tensor):
                out_types.append(([as_expr(s) for s in m.shape], m.dtype, [as_expr(s) for s in m.stride()]))
            elif m is None or (isinstance(m, (int, float, torch.SymInt)) and isinstance(meta, (list, tuple))):
                out_types.append(None)  # non-tensor parts of a tuple result are read through getitem
            else:
                raise GraphUnsupported(f"extern {origin} returns {type(m).__name__}")
        real = [t for t in out_types if t is not None]
        attrs = {
            "target": target,
            "args": args,
            "kwargs": kwargs,
            "tuple_result": isinstance(meta, (list, tuple)),
            "output_positions": [k for k, t in enumerate(out_types) if t is not None],
        }
        node = self.graph.add("extern", [], attrs, real, origin)
        node.inputs = values_in((args, kwargs))
        # A result on the host in a device graph (an ATen op over a CPU scalar: `torch.tensor(d).sqrt()`
        # in DeBERTa's attention) keeps its device: no kernel may read it where it is (`operand`).
        tensor_metas = [m for m in metas if isinstance(m, torch.Tensor)]
        for value, m in zip(node.outputs, tensor_metas, strict=True):
            if m.device.type == "cpu" and self.graph.device.type != "cpu":
                value.device = m.device
        outs = iter(node.outputs)
        results = [next(outs) if t is not None else None for t in out_types]
        if isinstance(meta, (list, tuple)):
            return tuple(results)
        return results[0]


class ToDevice:
    """An extern target that copies a (CPU scalar) tensor to the graph's device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.__name__ = "to_device"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, non_blocking=True)


def node_meta(node: torch.fx.Node) -> Any:
    """The value AOTAutograd recorded for an FX node (a FakeTensor, a SymInt, a tuple of them)."""
    if "val" not in node.meta:
        raise GraphUnsupported(f"FX node {node.name} has no meta['val']")
    return node.meta["val"]


def op_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet or target, "__name__", None) or str(target)


def values_in(tree) -> list[Value]:
    """The Values in nested lists, tuples and dicts, in order."""
    found: list[Value] = []

    def walk(x):
        if isinstance(x, Value):
            found.append(x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        elif isinstance(x, dict):
            for y in x.values():
                walk(y)

    walk(tree)
    return found


def _promoted(operands) -> torch.dtype:
    """The dtype a comparison computes in, by PyTorch's promotion rules (0-dim tensors rank low)."""
    samples = []
    for x in operands:
        if isinstance(x, Value):
            samples.append(torch.empty((1,) * max(1, len(x.shape)) if x.shape else (), dtype=x.dtype))
        elif isinstance(x, Expr):
            samples.append(1)
        else:
            samples.append(x)
    if len(samples) == 1:
        return samples[0].dtype if isinstance(samples[0], torch.Tensor) else torch.float32
    return torch.result_type(samples[0], samples[1])
