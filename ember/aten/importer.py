"""Import an ATen FX graph (from AOTAutograd) into ember's graph IR: the driver.

The importer walks the FX graph in order. Inputs, constants and outputs it binds itself; each
call goes to its op's lowering (registry.py), which adds ember nodes through the graph builder
(builder.py). A node whose op has no lowering, or whose lowering declines (`Unsupported`: an
integer input to a float-only op, a tensor on another device, ...), becomes an `extern` node: an
ATen call at run time. So an unsupported op never fails a compile; it only runs unfused.
"""

from __future__ import annotations

import operator

import sympy
import torch
import torch.fx

from ember import config
from ember.aten import lowerings  # noqa: F401  (its modules fill the registry)
from ember.aten.builder import GraphBuilder, ShapeDtype, node_meta, op_name, values_in
from ember.aten.collectives import collective_role
from ember.aten.inplace import mark_inplace
from ember.aten.registry import GraphUnsupported, Unsupported, lowering_for
from ember.ir.graph import COMPUTED_OPS, Graph, Value, layout_of
from ember.ir.sizes import Expr, as_expr, from_torch_sympy, symbol_ranges
from ember.target import LowerHeuristics


class Importer:
    """One FX graph's import: binds each FX node to its ember value, through the lowerings."""

    def __init__(self, gm: torch.fx.GraphModule, device: torch.device, compile_subgraph=None, lower=None):
        self.gm = gm
        self.builder = GraphBuilder(Graph(device), lower)
        self.builder.compile_subgraph = compile_subgraph
        # The nodes lowered to ember IR, in order. `ember bisect` sets bisect_ops=N: the first N
        # are lowered and every later op runs as an ATen extern.
        self.lowered: list[torch.fx.Node] = []
        limit = config.get("bisect_ops")
        self.limit = None if limit < 0 else limit
        # Graph inputs the graph writes -> their new values (see _input_mutation).
        self.mutations: dict[Value, Value] = {}

    @property
    def graph(self) -> Graph:
        return self.builder.graph

    # -- entry ---------------------------------------------------------------------------
    def run(self) -> Graph:
        env = self.builder.env
        for node in self.gm.graph.nodes:
            self.builder.current = node
            if node.op == "placeholder":
                env[node] = self._placeholder(node)
            elif node.op == "call_function":
                env[node] = self._call(node)
            elif node.op == "get_attr":
                env[node] = self._constant_tensor(node)
            elif node.op == "output":
                # One value, not a tuple: a while_loop's condition graph returns its predicate.
                outs = (node.args[0],) if isinstance(node.args[0], torch.fx.Node) else node.args[0]
                self.graph.outputs = [self._output(a) for a in outs]
                for inp, new in self.mutations.items():
                    self.graph.mutations.append((inp, len(self.graph.outputs)))
                    self.graph.outputs.append(new)
            else:
                raise GraphUnsupported(f"FX op {node.op} ({node.target})")
        return self.graph

    def _placeholder(self, node):
        val = node_meta(node)
        if isinstance(val, torch.Tensor):
            shape, stride = [as_expr(s) for s in val.shape], [as_expr(s) for s in val.stride()]
            value = self.graph.add_input(shape, val.dtype, stride, device=val.device)
            if val.device == self.graph.device:
                return value
            # On another device: never a kernel operand, the ops reading it run as externs.
            if val.dim() == 0 and val.device.type == "cpu":
                # A CPU scalar tensor beside device tensors (eager allows it: masked_fill's value):
                # one copy to the device, and kernels read it like any other input.
                return self.builder.to_device(value, origin=f"{node.name} to device")
            return value
        if isinstance(val, (torch.SymInt, int)):
            expr = as_expr(val)
            self.graph.add_symbolic_input(expr)
            return expr
        raise GraphUnsupported(f"input {node.name} of type {type(val).__name__}")

    def _constant_tensor(self, node):
        tensor = getattr(self.gm, node.target)
        if isinstance(tensor, torch.fx.GraphModule):
            # A higher-order op's function (a cond branch, a loop body, flex_attention's score_mod):
            # its lowering reads it.
            return tensor
        return self.builder.extern_call(_ConstantTensor(tensor), (), {}, tensor, origin=f"constant {node.target}")

    def _output(self, arg):
        if not isinstance(arg, torch.fx.Node):
            return arg
        value = self.builder.env[arg]
        if self.builder.is_sym_float(value):
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
            return _condition(node, val)
        if isinstance(val, torch.SymFloat):
            return self._sym_float(node)
        if isinstance(val, torch.SymInt) or (
            isinstance(val, int) and not isinstance(val, bool) and node.target is not operator.getitem
        ):
            # Size arithmetic (sym_size, operator.mul on SymInts, math.floor of a size's division): its
            # value is an expression of the graph's sizes, whatever computed it.
            return as_expr(val)
        self._check_sym_float_use(node)
        if node.target is torch.ops.aten.copy_.default:
            return self._input_mutation(node)
        if node.target is operator.getitem:
            if isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
                return as_expr(val)  # an extern's integer result (e.g. cuDNN attention's max_q)
            return self.builder.env[node.args[0]][node.args[1]]
        lower = lowering_for(node.target)
        if lower is not None and (self.limit is None or len(self.lowered) < self.limit):
            try:
                result = lower(self.builder, node)
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
        return self._extern(node)

    def _input_mutation(self, node) -> Value:
        """`copy_(input, src)`: AOTAutograd's in-graph mutation of a graph input (batch norm's running
        statistics, compiled with keep_inference_input_mutations). The graph computes the new value
        as an output; the host program leaves it in the input (memory plan: in place where the
        kernel computing it is the input's last reader, else one copy at the end); a scatter-like
        extern computing it may run in place on the input (inplace.py). Any other
        copy_ (into an intermediate) is a mutation the scheduler does not order around."""
        b = self.builder
        dst_node, src = node.args[0], b.arg(node.args[1])
        dst = b.env.get(dst_node)
        if dst_node.op != "placeholder" or not isinstance(dst, Value) or dst.device != self.graph.device:
            raise GraphUnsupported("mutating op copy_ (into a value that is not a graph input on its device)")
        if dst in self.mutations:
            raise GraphUnsupported(f"input {dst_node.name} mutated twice")
        if not isinstance(src, Value) or src.device != self.graph.device:
            raise GraphUnsupported("copy_ from a value on another device")
        if mark_inplace(src, dst):
            self.mutations[dst] = src
            return src
        new = b.cast(src, dst.dtype)
        if tuple(new.shape) != tuple(dst.shape):
            new = b.view("expand", new, shape=tuple(dst.shape))
        if new.node.op in COMPUTED_OPS and new.stride is None and dst.stride is not None:
            new.stride = tuple(dst.stride)  # computed in the input's layout, so it can be written there
        self.mutations[dst] = new
        return new  # what reads the copy_'s result reads the input's new value

    def _sym_float(self, node) -> Value:
        """A float computed from sizes (var's backward scales by 2.0 / (float(N) - 1.0)): a 0-d float64
        value, computed in double as eager's Python float is, which a tensor op then reads as a scalar
        operand (converted to the op's compute dtype, as eager converts a Python scalar)."""
        b = self.builder
        args = [b.arg(a) for a in node.args]
        if node.target is torch.sym_float and len(args) == 1 and isinstance(args[0], (int, Expr)):
            out = b.full(as_expr(args[0]), (), torch.float64, origin="sym_float")
        elif node.target in _SYM_FLOAT_OPS and not node.kwargs:
            if not all(isinstance(a, (int, float, Expr)) or b.is_sym_float(a) for a in args):
                raise GraphUnsupported(f"symbolic float {node.name} of {[type(a).__name__ for a in args]}")
            operands = [float(a) if isinstance(a, int) else a for a in args]  # float(N) - 1: double math
            out = b.pointwise(_SYM_FLOAT_OPS[node.target], operands, ShapeDtype((), torch.float64))
        else:
            raise GraphUnsupported(f"symbolic float {node.name} ({node.target})")
        b.sym_floats.add(out)
        return out

    def _check_sym_float_use(self, node) -> None:
        """A symbolic float may be a scalar operand of elementwise arithmetic (where a 0-d value and a
        Python scalar act alike) and nothing else: a lowering or an extern expecting a number gets a
        tensor."""
        b = self.builder
        if not any(b.is_sym_float(b.env.get(n)) for n in node.all_input_nodes):
            return
        in_kwargs: list = []
        torch.fx.node.map_arg(node.kwargs, in_kwargs.append)
        positional = getattr(node.target, "overloadpacket", None) in _SYM_FLOAT_CONSUMERS
        if not positional or any(b.is_sym_float(b.env.get(n)) for n in in_kwargs):
            raise GraphUnsupported(f"symbolic float used by {op_name(node.target)}")

    def _extern(self, node: torch.fx.Node):
        """The node as an ATen call at run time, unless that cannot be right for the graph."""
        b = self.builder
        schema = getattr(node.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            # Fused kernels may be ordered around it; until the scheduler orders around
            # mutations, a graph that mutates runs eagerly.
            raise GraphUnsupported(f"mutating op {op_name(node.target)}")
        if _static_shape_promised_for_data_dependent(node):
            # The host program trusts an extern's meta shape (it indexes and allocates by it); a
            # fixed size for an op whose size depends on data cannot be right (torch 2.11's fake
            # `_unique` on CUDA: index_fill's backward promised (5, 1) and got (5, 3)).
            raise GraphUnsupported(f"{op_name(node.target)}: data-dependent output shape promised as fixed")
        args = b.arg(node.args)
        kwargs = {k: b.arg(v) for k, v in node.kwargs.items()}
        if any(b.is_sym_float(v) for v in values_in((args, kwargs))):
            raise GraphUnsupported(f"symbolic float passed to {op_name(node.target)}, which runs as an ATen call")
        result = b.extern_call(node.target, args, kwargs, node.meta.get("val"), origin=op_name(node.target))
        role = collective_role(node.target)
        if role is not None:
            first = next(v for v in (result if isinstance(result, tuple) else (result,)) if v is not None)
            first.node.attrs["collective"] = role  # the scheduler starts it early, waits on it late
        return result


def _condition(node: torch.fx.Node, val: torch.SymBool):
    """A SymBool (a check on a data-dependent size, a predicate over sizes) as a sympy condition over
    ember's size symbols, which the host program evaluates."""
    try:
        return from_torch_sympy(val.node.expr, symbol_ranges(val.node))
    except (TypeError, AttributeError) as e:
        raise GraphUnsupported(f"symbolic boolean {node.name}: {e}") from None


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


def import_graph(
    gm: torch.fx.GraphModule, device: torch.device, compile_subgraph=None, lower: LowerHeuristics | None = None
) -> Graph:
    """`compile_subgraph(gm, what)`: compiles a cond branch or loop body into a callable of a list of
    inputs (builder.GraphBuilder.compile_subgraph); without it, those ops run as ATen calls. `lower`: the
    target's choices of ops computed by ember rather than a library (Target.heuristics.lower)."""
    return Importer(gm, device, compile_subgraph, lower).run()
