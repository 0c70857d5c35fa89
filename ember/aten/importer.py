"""Import an ATen FX graph (from AOTAutograd) into ember's graph IR.

Each FX node goes through the op registry (lowerings.py). A node whose op has no lowering,
or whose lowering declines (`Unsupported`: an integer input to a float-only op, a tensor on
another device, ...), becomes an `extern` node: an ATen call at run time. So an
unsupported op never fails a compile; it only runs unfused.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch
import torch.fx

from ember import config
from ember.ir import dtypes, ops
from ember.ir.graph import COMPUTED_OPS, Graph, Value, layout_of
from ember.ir.sizes import Expr, as_expr, product
from ember.ir.views import VIEW_KINDS


class Unsupported(Exception):
    """A lowering declines this node; the importer makes it an extern instead."""


class GraphUnsupported(Exception):
    """The whole graph cannot be compiled (the backend falls back to eager)."""


LOWERINGS: dict[Any, Callable[[Importer, torch.fx.Node], Any]] = {}


def lowering(*targets):
    """Register a lowering for ATen op packets or overloads (one function per op family)."""

    def register(fn):
        for t in targets:
            LOWERINGS[t] = fn
        return fn

    return register


def _meta(node: torch.fx.Node) -> Any:
    if "val" not in node.meta:
        raise GraphUnsupported(f"FX node {node.name} has no meta['val']")
    return node.meta["val"]


class Importer:
    def __init__(self, gm: torch.fx.GraphModule, device: torch.device):
        self.gm = gm
        self.graph = Graph(device)
        self.env: dict[torch.fx.Node, Any] = {}
        self.current: torch.fx.Node | None = None
        # The nodes lowered to ember IR, in order. `ember bisect` sets bisect_ops=N: the first N
        # are lowered and every later op runs as an ATen extern.
        self.lowered: list[torch.fx.Node] = []
        limit = config.get("bisect_ops")
        self.limit = None if limit < 0 else limit
        # Graph inputs the graph writes -> their new values (see _input_mutation).
        self.mutations: dict[Value, Value] = {}
        # Floats computed from sizes (SymFloat), held as 0-d float64 values (see _sym_float).
        self.sym_floats: set[Value] = set()

    # -- entry ---------------------------------------------------------------------------
    def run(self) -> Graph:
        for node in self.gm.graph.nodes:
            self.current = node
            if node.op == "placeholder":
                self.env[node] = self._placeholder(node)
            elif node.op == "call_function":
                self.env[node] = self._call(node)
            elif node.op == "get_attr":
                self.env[node] = self._constant_tensor(node)
            elif node.op == "output":
                self.graph.outputs = [self._output(a) for a in node.args[0]]
                for inp, new in self.mutations.items():
                    self.graph.mutations.append((inp, len(self.graph.outputs)))
                    self.graph.outputs.append(new)
            else:
                raise GraphUnsupported(f"FX op {node.op} ({node.target})")
        return self.graph

    def _placeholder(self, node):
        val = _meta(node)
        if isinstance(val, torch.Tensor):
            shape, stride = [as_expr(s) for s in val.shape], [as_expr(s) for s in val.stride()]
            value = self.graph.add_input(shape, val.dtype, stride, device=val.device)
            if val.device == self.graph.device:
                return value
            # On another device: never a kernel operand, the ops reading it run as externs.
            if val.dim() == 0 and val.device.type == "cpu":
                # A CPU scalar tensor beside device tensors (eager allows it: masked_fill's value):
                # one copy to the device, and kernels read it like any other input.
                meta = torch.empty((), dtype=val.dtype, device="meta")
                return self.extern_call(
                    _ToDevice(self.graph.device), (value,), {}, meta, origin=f"{node.name} to device"
                )
            return value
        if isinstance(val, (torch.SymInt, int)):
            expr = as_expr(val)
            self.graph.add_symbolic_input(expr)
            return expr
        raise GraphUnsupported(f"input {node.name} of type {type(val).__name__}")

    def _constant_tensor(self, node):
        tensor = getattr(self.gm, node.target)
        return self.extern_call(_ConstantTensor(tensor), (), {}, tensor, origin=f"constant {node.target}")

    def _output(self, arg):
        if not isinstance(arg, torch.fx.Node):
            return arg
        value = self.env[arg]
        if self._is_sym_float(value):
            raise GraphUnsupported(f"symbolic float {arg.name} as a graph output")
        meta = arg.meta.get("val")
        # Return outputs in eager's layout (x.t() * 2 keeps x's column-major strides), as
        # Inductor does: code after the graph may depend on strides. Static layouts only.
        if (
            isinstance(value, Value)
            and value.node.op in COMPUTED_OPS
            and value.stride is None
            and isinstance(meta, torch.Tensor)
        ):
            try:
                stride = tuple(as_expr(s) for s in meta.stride())
            except TypeError:
                return value  # strides ember has no code for (torch's Max(1, n)): keep ember's own
            hints = [s if isinstance(s, int) else s.node.hint for s in meta.stride()]
            # Symbolic strides too: a forward graph's output saved for the backward is read there with
            # the strides AOTAutograd recorded, so ember must produce them (a transposed input's exp).
            if _is_dense(value.shape, stride) or _is_dense_symbolic(value.shape, stride, hints):
                value.stride = stride
        return value

    def _call(self, node):
        val = node.meta.get("val")
        if isinstance(val, torch.SymBool):
            raise GraphUnsupported(f"symbolic boolean {node.name}")
        if isinstance(val, torch.SymFloat):
            return self._sym_float(node)
        self._check_sym_float_use(node)
        if isinstance(val, torch.SymInt) or (
            isinstance(val, int) and not isinstance(val, bool) and node.target is not operator.getitem
        ):
            # Size arithmetic (sym_size, operator.mul on SymInts): its value is an expression.
            return as_expr(val)
        if node.target is torch.ops.aten.copy_.default:
            return self._input_mutation(node)
        if node.target is operator.getitem:
            if isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
                return as_expr(val)  # an extern's integer result (e.g. cuDNN attention's max_q)
            return self.env[node.args[0]][node.args[1]]
        lower = LOWERINGS.get(node.target) or LOWERINGS.get(getattr(node.target, "overloadpacket", None))
        if lower is not None and (self.limit is None or len(self.lowered) < self.limit):
            try:
                result = lower(self, node)
            except Unsupported:
                pass
            else:
                self.lowered.append(node)
                meta = node.meta.get("val")
                if isinstance(result, (tuple, list)) and isinstance(meta, (tuple, list)):
                    for value, value_meta in zip(result, meta):  # max_pool2d's values and indices
                        _take_permuted_layout(value, value_meta)
                else:
                    _take_permuted_layout(result, meta)
                return result
        return self.extern(node)

    def _input_mutation(self, node) -> Value:
        """`copy_(input, src)`: AOTAutograd's in-graph mutation of a graph input (batch norm's running
        statistics, compiled with keep_inference_input_mutations). The graph computes the new value
        as an output; the host program leaves it in the input (memory plan: in place where the
        kernel computing it is the input's last reader, else one copy at the end). Any other
        copy_ (into an intermediate) is a mutation the scheduler does not order around."""
        dst_node, src = node.args[0], self.arg(node.args[1])
        dst = self.env.get(dst_node)
        if dst_node.op != "placeholder" or not isinstance(dst, Value) or dst.device != self.graph.device:
            raise GraphUnsupported("mutating op copy_ (into a value that is not a graph input on its device)")
        if dst in self.mutations:
            raise GraphUnsupported(f"input {dst_node.name} mutated twice")
        if not isinstance(src, Value) or src.device != self.graph.device:
            raise GraphUnsupported("copy_ from a value on another device")
        new = self.cast(src, dst.dtype)
        if tuple(new.shape) != tuple(dst.shape):
            new = self.view("expand", new, shape=tuple(dst.shape))
        if new.node.op in COMPUTED_OPS and new.stride is None and dst.stride is not None:
            new.stride = tuple(dst.stride)  # computed in the input's layout, so it can be written there
        self.mutations[dst] = new
        return new  # what reads the copy_'s result reads the input's new value

    def _sym_float(self, node) -> Value:
        """A float computed from sizes (var's backward scales by 2.0 / (float(N) - 1.0)): a 0-d float64
        value, computed in double as eager's Python float is, which a tensor op then reads as a scalar
        operand (converted to the op's compute dtype, as eager converts a Python scalar)."""
        args = [self.arg(a) for a in node.args]
        if node.target is torch.sym_float and len(args) == 1 and isinstance(args[0], (int, Expr)):
            value = as_expr(args[0])
            out = self.graph.add("full", [], {"value": value}, [((), torch.float64, None)], "sym_float").out
        elif node.target in _SYM_FLOAT_OPS and not node.kwargs:
            if not all(isinstance(a, (int, float, Expr)) or self._is_sym_float(a) for a in args):
                raise GraphUnsupported(f"symbolic float {node.name} of {[type(a).__name__ for a in args]}")
            operands = [float(a) if isinstance(a, int) else a for a in args]  # float(N) - 1: double math
            fn = _SYM_FLOAT_OPS[node.target]
            out = self.pointwise(fn, operands, ShapeDtype((), torch.float64))
        else:
            raise GraphUnsupported(f"symbolic float {node.name} ({node.target})")
        self.sym_floats.add(out)
        return out

    def _check_sym_float_use(self, node) -> None:
        """A symbolic float may be a scalar operand of elementwise arithmetic (where a 0-d value and a
        Python scalar act alike) and nothing else: a lowering or an extern expecting a number gets a
        tensor."""
        if not any(self._is_sym_float(self.env.get(n)) for n in node.all_input_nodes):
            return
        in_kwargs: list = []
        torch.fx.node.map_arg(node.kwargs, in_kwargs.append)
        positional = getattr(node.target, "overloadpacket", None) in _SYM_FLOAT_CONSUMERS
        if not positional or any(self._is_sym_float(self.env.get(n)) for n in in_kwargs):
            raise GraphUnsupported(f"symbolic float used by {_op_name(node.target)}")

    def _is_sym_float(self, x) -> bool:
        return isinstance(x, Value) and x in self.sym_floats

    # -- helpers for lowerings ------------------------------------------------------------
    @property
    def origin(self) -> str:
        return _op_name(self.current.target) if self.current is not None else ""

    def arg(self, x) -> Any:
        """An FX argument as an IR operand: Value, sympy expression, or Python scalar."""
        if isinstance(x, torch.fx.Node):
            return self.env[x]
        if isinstance(x, (list, tuple)):
            return type(x)(self.arg(a) for a in x)
        return x

    def out_meta(self) -> torch.Tensor:
        val = _meta(self.current)
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
        """A kernel operand: a Value on the graph's device with a kernel dtype, or a scalar."""
        if isinstance(x, Value):
            self.check_kernel_tensor(x)
            return x
        if isinstance(x, (bool, int, float, Expr)):
            return x
        raise Unsupported(f"operand {type(x).__name__}")

    def pointwise(self, fn: str, operands, out: torch.Tensor | None = None, **attrs) -> Value:
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

    def numel(self, x: Value, dims) -> Expr:
        return product(x.shape[d] for d in dims) if dims else product(x.shape)

    def extern(self, node: torch.fx.Node) -> Any:
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            # Fused kernels may be ordered around it; until the scheduler orders around
            # mutations, a graph that mutates runs eagerly.
            raise GraphUnsupported(f"mutating op {_op_name(node.target)}")
        if _static_shape_promised_for_data_dependent(node):
            # The host program trusts an extern's meta shape (it indexes and allocates by it); a
            # fixed size for an op whose size depends on data cannot be right (torch 2.11's fake
            # `_unique` on CUDA: index_fill's backward promised (5, 1) and got (5, 3)).
            raise GraphUnsupported(f"{_op_name(node.target)}: data-dependent output shape promised as fixed")
        args = self.arg(node.args)
        kwargs = {k: self.arg(v) for k, v in node.kwargs.items()}
        if any(self._is_sym_float(v) for v in _values_in((args, kwargs))):
            raise GraphUnsupported(f"symbolic float passed to {_op_name(node.target)}, which runs as an ATen call")
        return self.extern_call(node.target, args, kwargs, node.meta.get("val"), origin=_op_name(node.target))

    def extern_call(self, target, args, kwargs, meta, origin: str) -> Any:
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
        node.inputs = _values_in((args, kwargs))
        outs = iter(node.outputs)
        results = [next(outs) if t is not None else None for t in out_types]
        if isinstance(meta, (list, tuple)):
            return tuple(results)
        return results[0]


# Ops whose result size always depends on the data (the `dynamic_output_shape` tag also marks
# index, one_hot and repeat_interleave, whose size is static for most arguments).
_DATA_DEPENDENT_SIZE = {
    "_unique",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "nonzero",
    "masked_select",
    "bincount",
}


def _static_shape_promised_for_data_dependent(node: torch.fx.Node) -> bool:
    packet = getattr(node.target, "overloadpacket", None)
    if packet is None or packet.__name__ not in _DATA_DEPENDENT_SIZE:
        return False
    metas = node.meta.get("val")
    metas = metas if isinstance(metas, (list, tuple)) else [metas]
    shapes = [m.shape for m in metas if isinstance(m, torch.Tensor)]
    return bool(shapes) and all(isinstance(s, int) for shape in shapes for s in shape)


class _ToDevice:
    """An extern target that copies a (CPU scalar) tensor to the graph's device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.__name__ = "to_device"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device, non_blocking=True)


class _ConstantTensor:
    """An extern target that returns a constant captured at compile time (FX get_attr)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor
        self.__name__ = "constant"

    def __call__(self) -> torch.Tensor:
        return self.tensor


# Python arithmetic on SymFloats that AOTAutograd leaves in a graph, and the ATen ops that may read
# the result: a symbolic float reaches a kernel as a scalar operand of one of these, nothing else.
_SYM_FLOAT_OPS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "truediv"}
_SYM_FLOAT_CONSUMERS = (torch.ops.aten.mul, torch.ops.aten.div, torch.ops.aten.add, torch.ops.aten.sub)


def _take_permuted_layout(value, meta) -> None:
    """A computed value that eager lays out as a permutation of row-major (a channels-last
    activation: the BN + ReLU between two convolutions) gets that layout, should it be stored:
    written row-major, its kernel would walk its input across strides and the convolution
    after it would convert it back (cuDNN's nchwToNhwc) and return its own result in the other
    layout. Static strides only; row-major ones change nothing."""
    if not isinstance(value, Value) or value.node.op not in COMPUTED_OPS or value.stride is not None:
        return
    if not isinstance(meta, torch.Tensor) or meta.dim() < 2 or tuple(meta.shape) != tuple(value.shape):
        return
    stride = meta.stride()
    if not all(isinstance(x, int) for x in (*meta.shape, *stride)):
        return
    stride = tuple(as_expr(x) for x in stride)
    if _is_dense(value.shape, stride) and tuple(stride) != tuple(layout_of(value)):
        value.stride = stride


def _is_dense_symbolic(shape, stride, hints) -> bool:
    """Whether symbolic strides lay the shape out densely: ordered by their example values, each is the
    product of the sizes before it."""
    if any(h is None for h in hints) or all(e.is_Integer for e in tuple(shape) + tuple(stride)):
        return False
    dims = sorted(
        ((h, st, sz) for sz, st, h in zip(shape, stride, hints) if not (sz.is_Integer and int(sz) == 1)),
        key=lambda d: d[0],
    )
    expected = sympy.Integer(1)
    for _, st, sz in dims:
        if sympy.simplify(st - expected) != 0:
            return False
        expected = expected * sz
    return True


def _is_dense(shape, stride) -> bool:
    """Whether static strides lay the shape out densely (a permutation of row-major)."""
    if not all(e.is_Integer for e in tuple(shape) + tuple(stride)):
        return False
    dims = sorted((int(st), int(sz)) for sz, st in zip(shape, stride) if int(sz) != 1)
    expected = 1
    for st, sz in dims:
        if st != expected:
            return False
        expected *= sz
    return True


class ShapeDtype:
    """The output meta of a value a lowering makes itself (not read off an FX node)."""

    def __init__(self, shape, dtype):
        self.shape = shape
        self.dtype = dtype


def _values_in(tree) -> list[Value]:
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


def _op_name(target) -> str:
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet or target, "__name__", None) or str(target)


def import_graph(gm: torch.fx.GraphModule, device: torch.device) -> Graph:
    from ember.aten import lowerings, pooling  # noqa: F401  (fill LOWERINGS)

    return Importer(gm, device).run()
