"""ember's graph IR: an SSA graph of typed tensor values.

A `Value` is a tensor with a symbolic shape and a dtype; a `Node` is one op from ember's op
set (see ops.py) with its inputs, attributes and output values. Op kinds:

    input      a graph input (tensor); its strides come from Dynamo's example
    pointwise  attrs.fn names a row of ops.POINTWISE; inputs broadcast to the output shape
    cast       convert to attrs.dtype (rounds when the target is a narrower float)
    reduce     attrs.kind in ops.REDUCTIONS over attrs.dims, attrs.keepdim
    view       attrs.kind in views.VIEW_KINDS; folded into index math, never a copy by itself
    full       a constant tensor, attrs.value
    iota       attrs.start + attrs.step * i, 1-D
    extern     an ATen call at run time (matmul, conv, SDPA, anything not lowered)

Scalars (Python numbers) may appear directly as pointwise inputs.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ember.ir.sizes import Expr, contiguous_strides

_DTYPE_ABBREV = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.bfloat16: "bf16",
    torch.float16: "f16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "b8",
}


# Ops whose values ember's kernels compute (everything else is an input, a view or an extern).
COMPUTED_OPS = ("pointwise", "cast", "reduce", "full", "iota")


def dtype_abbrev(dtype: torch.dtype) -> str:
    return _DTYPE_ABBREV.get(dtype, str(dtype).replace("torch.", ""))


class Value:
    """A tensor value. `stride` is known for inputs and extern outputs (their layout is not ours)."""

    __slots__ = ("device", "dtype", "id", "node", "shape", "stride")

    def __init__(self, id: int, shape, dtype, node, device, stride=None):
        self.id = id
        self.shape: tuple[Expr, ...] = tuple(shape)
        self.dtype: torch.dtype = dtype
        self.node: Node = node
        self.device: torch.device = device
        self.stride: tuple[Expr, ...] | None = tuple(stride) if stride is not None else None

    @property
    def name(self) -> str:
        return f"v{self.id}"

    @property
    def type_str(self) -> str:
        return f"{dtype_abbrev(self.dtype)}[{', '.join(str(s) for s in self.shape)}]"

    def __repr__(self) -> str:
        return f"%{self.name}: {self.type_str}"


@dataclass(eq=False)
class Node:
    op: str
    inputs: list[Any]  # Values or Python scalars
    attrs: dict[str, Any]
    outputs: list[Value] = field(default_factory=list)
    origin: str = ""  # the ATen op this node came from, for reports
    fx_node: str = ""  # the name of the ATen FX node it came from (whose source line reports show)

    @property
    def out(self) -> Value:
        assert len(self.outputs) == 1, f"{self.op} has {len(self.outputs)} outputs"
        return self.outputs[0]

    def value_inputs(self) -> list[Value]:
        return [x for x in self.inputs if isinstance(x, Value)]


class Graph:
    def __init__(self, device: torch.device):
        self.device = device
        self.nodes: list[Node] = []
        # Graph inputs in calling order: a tensor Value, or a sympy expression for a SymInt input.
        self.inputs: list[Value | Expr] = []
        # Graph outputs in order: a Value, a sympy expression (SymInt), or a Python constant / None.
        self.outputs: list[Any] = []
        # Inputs the graph writes (AOTAutograd's in-graph input mutations: batch norm's running
        # statistics): (the input, the position in `outputs` of its new value). Those outputs come
        # last and are not returned; the host program leaves each new value in its input.
        self.mutations: list[tuple[Value, int]] = []
        self._next_id = 0  # an int, not itertools.count: a graph is pickled (runtime/schedule_cache.py)
        # The ATen FX node the nodes added now come from (the importer sets it per node).
        self.current_fx_node = ""

    # -- construction -------------------------------------------------------------------
    def add(self, op: str, inputs, attrs, out_types, origin: str = "") -> Node:
        """Append a node; out_types is a list of (shape, dtype, stride-or-None)."""
        node = Node(op, list(inputs), dict(attrs), origin=origin, fx_node=getattr(self, "current_fx_node", ""))
        for shape, dtype, stride in out_types:
            node.outputs.append(Value(self._next_id, shape, dtype, node, self.device, stride))
            self._next_id += 1
        self.nodes.append(node)
        return node

    def add_input(self, shape, dtype, stride, device: torch.device | None = None) -> Value:
        """A graph input; `device` when it lives elsewhere than the graph (then no kernel reads it)."""
        node = self.add("input", [], {"index": len(self.inputs)}, [(shape, dtype, stride)])
        if device is not None:
            node.out.device = device
        self.inputs.append(node.out)
        return node.out

    def add_symbolic_input(self, expr: Expr) -> None:
        self.inputs.append(expr)

    def replace_uses(self, old: Value, new: Value) -> None:
        """Point every use of `old` (node inputs, extern argument trees, outputs) at `new`."""
        self.substitute({id(old): new}, self.nodes)
        self.outputs = substituted(self.outputs, {id(old): new})

    def substitute(self, subst: dict[int, Value], nodes: list[Node]) -> None:
        """In `nodes`, point each use of a Value whose id is in `subst` at its replacement."""
        for node in nodes:
            if _may_mention(node.inputs, subst):
                node.inputs = substituted(node.inputs, subst)
            if node.op == "extern":
                node.attrs["args"] = substituted(node.attrs["args"], subst)
                node.attrs["kwargs"] = substituted(node.attrs["kwargs"], subst)

    def user_outputs(self) -> list[Any]:
        """The outputs the compiled graph returns (the new values of mutated inputs are not)."""
        return self.outputs[: len(self.outputs) - len(self.mutations)]

    # -- queries --------------------------------------------------------------------------
    def users(self) -> dict[Value, list[Node]]:
        users: dict[Value, list[Node]] = {}
        for node in self.nodes:
            for v in node.value_inputs():
                users.setdefault(v, []).append(node)
        return users

    def values(self) -> Iterator[Value]:
        for node in self.nodes:
            yield from node.outputs

    # -- printing -------------------------------------------------------------------------
    def __str__(self) -> str:
        lines = [f"graph({', '.join(_fmt_arg(i) for i in self.inputs)}):"]
        for node in self.nodes:
            if node.op == "input":
                continue
            outs = ", ".join(f"%{v.name}" for v in node.outputs)
            types = ", ".join(f'"{v.type_str}"' for v in node.outputs)
            args = ", ".join(_fmt_arg(x) for x in node.inputs)
            attrs = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in node.attrs.items() if k != "target_args")
            sep = ", " if args and attrs else ""
            lines.append(f"  {outs} = {node.op}({args}{sep}{attrs})  # {types} {node.origin}".rstrip())
        for inp, pos in self.mutations:
            lines.append(f"  {_fmt_arg(inp)} <- {_fmt_arg(self.outputs[pos])}  # input mutation")
        lines.append(f"  return ({', '.join(_fmt_arg(o) for o in self.user_outputs())})")
        return "\n".join(lines)


def _may_mention(inputs: list, subst: dict[int, Value]) -> bool:
    """Whether a node's inputs may hold a Value in `subst` (a nested container: maybe). Checked
    before rebuilding them: the split pass replaces uses one value at a time, over every node."""
    for x in inputs:
        if isinstance(x, Value):
            if id(x) in subst:
                return True
        elif isinstance(x, (list, tuple, dict)):
            return True
    return False


def substituted(x: Any, subst: dict[int, Value]) -> Any:
    """x with each Value whose id is in `subst` replaced, through lists, tuples and dicts."""
    if isinstance(x, Value):
        return subst.get(id(x), x)
    if isinstance(x, (list, tuple)):
        return type(x)(substituted(y, subst) for y in x)
    if isinstance(x, dict):
        return {k: substituted(v, subst) for k, v in x.items()}
    return x


def _fmt_arg(x: Any) -> str:
    if isinstance(x, Value):
        return f"%{x.name}"
    return str(x)


def _fmt_attr(x: Any) -> str:
    if isinstance(x, torch.dtype):
        return dtype_abbrev(x)
    if callable(x):
        return getattr(x, "__name__", str(x))
    return str(x)


def verify(graph: Graph) -> None:
    """Structural checks run between passes under EMBER_CHECK=1."""
    defined: set[int] = set()
    for node in graph.nodes:
        for v in node.value_inputs():
            if v.id not in defined:
                raise AssertionError(f"{node.op} uses %{v.name} before it is defined")
        if node.op == "pointwise":
            out = node.out.shape
            for x in node.value_inputs():
                if len(x.shape) > len(out):
                    raise AssertionError(f"pointwise input {x} has higher rank than its output {node.out}")
                for a, b in zip(reversed(x.shape), reversed(out)):
                    if a != b and a != 1:
                        raise AssertionError(f"pointwise input {x} does not broadcast to {node.out}")
        for v in node.outputs:
            defined.add(v.id)
    for o in graph.outputs:
        if isinstance(o, Value) and o.id not in defined:
            raise AssertionError(f"output %{o.name} is never defined")


def layout_of(value: Value) -> tuple[Expr, ...]:
    """Strides of a value's buffer: its known layout, else row-major."""
    return value.stride if value.stride is not None else contiguous_strides(value.shape)


__all__ = ["COMPUTED_OPS", "Graph", "Node", "Value", "dtype_abbrev", "layout_of", "sympy", "verify"]
