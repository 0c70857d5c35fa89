"""The host program: Python source that runs one compiled graph.

It binds symbolic sizes from the inputs, allocates each buffer where the memory plan says
(fresh, a dead buffer's memory, or in place of an input the kernel reads for the last time),
launches kernels, calls externs, makes aliases, frees buffers after their last use and
returns the outputs. Generating source rather than interpreting a
step list keeps the per-call overhead to plain Python statements, and the program can be
printed (EMBER_DEBUG=2) and read.

How a kernel is launched is the backend's business: it passes a launcher with
`launch_line(kernel, args)` and `prologue()` (lines run once per call, e.g. reading the current
CUDA stream). `args["buffers"]` names the kernel's buffers in parameter order and
`args["maybe_unaligned"]` those this program did not allocate itself (inputs, extern results,
aliases): only those can start at an address that is not 16-byte aligned. `args["same"]` gives,
per buffer, the first name of the kernel's buffers that is bound to the same tensor (a buffer
written in place of an input it reads is that input), for launches that pay per tensor passed.
"""

from __future__ import annotations

import keyword
import math
import re
from collections.abc import Callable
from typing import Any

import sympy
import torch

from ember import config
from ember.codegen.render import print_host_index
from ember.ir.graph import Value, layout_of
from ember.ir.sizes import Expr, contiguous_strides
from ember.runtime import heap
from ember.runtime.huge_pages import MIN_BYTES, huge_allocator
from ember.schedule.kernel import kernel_parts
from ember.schedule.memory import MemoryPlan, same_layout
from ember.schedule.padding import AlignedProduct
from ember.schedule.steps import AliasStep, ExternStep, KernelStep, Schedule

# ATen ops whose torch-level function is the same op with the same signature, reached through
# the Python argument parser instead of OpOverload.__call__: torch.addmm takes 4.97 us where
# aten.addmm.default takes 5.7-6.4 (2-core CPU machine, [1, 256] @ [256, 256]). A call with any
# other keyword keeps the ATen overload.
_TORCH_FUNCTIONS = {
    torch.ops.aten.mm.default: (torch.mm, frozenset()),
    torch.ops.aten.addmm.default: (torch.addmm, frozenset({"beta", "alpha"})),
    torch.ops.aten.bmm.default: (torch.bmm, frozenset()),
    torch.ops.aten.baddbmm.default: (torch.baddbmm, frozenset({"beta", "alpha"})),
}


_DENSE_PRODUCTS = frozenset(_TORCH_FUNCTIONS)


def _fast_target(target: Any, kwargs: dict) -> Any:
    fast = _TORCH_FUNCTIONS.get(target)
    if fast is None or not set(kwargs) <= fast[1]:
        return target
    return fast[0]


def _constant_name(obj: Any, number: int) -> str:
    """The host program's name for a constant it calls or passes: the op's, numbered, for an extern
    (`mm_6(...)`, `convolution_backward_12(...)`, `sort_stable_3(...)`), so the printed program
    says what each call does; `c6` for anything else. Numbers keep names apart; no local variable
    of the program (a0, buf3, v4, r5, size symbols) has an underscore before its number."""
    if isinstance(obj, torch._ops.OpOverload):
        base = obj._opname + ("" if obj._overloadname == "default" else f"_{obj._overloadname}")
    elif callable(obj):
        base = getattr(obj, "__name__", "")
    else:
        base = ""
    base = re.sub(r"\W+", "_", base).strip("_")
    return f"{base}_{number}" if base.isidentifier() else f"c{number}"


class HostProgram:
    def __init__(self, source: str, namespace: dict[str, Any], table_inputs: frozenset[int] = frozenset()):
        self.source = source
        self.namespace = namespace
        code = compile(source, "<ember host program>", "exec")
        exec(code, namespace)  # noqa: S102  (our own generated source; printed by EMBER_DEBUG=2)
        self.call: Callable = namespace["call"]
        # Input positions that only table combo kernels read or write, through an address table
        # (backends/table_launch.py): a CUDA graph replay may take them at new addresses by
        # rewriting the tables, without copying them (runtime/cudagraph_pool.py).
        self.table_inputs = table_inputs

    @property
    def table_rows(self) -> int:
        """Address-table rows a call's table launches take (backends/table_launch.py: rows_per_call), which a
        capture sets aside before it starts (runtime/cudagraph_capture.py: CaptureScope.lasting). Read once the
        backend's launches have joined the namespace."""
        return sum(getattr(v, "rows_per_call", 0) for k, v in self.namespace.items() if k.startswith("_tables_"))


_IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
_BINDING = re.compile(r"\w+ = \w+  # (in place|reuse)")  # HostWriter._allocate: a second name, no access


def _alias_fallback(base: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    return torch.as_strided(base, size, stride, base.storage_offset() + offset)


# A view of `base` at `offset` elements past its own: PyTorch's C++ helper (what Inductor's host
# code calls) makes it in about half of torch.as_strided's time; the fallback where it is absent.
try:
    from torch._C._dynamo.guards import _reinterpret_tensor as _alias
except ImportError:  # pragma: no cover - present in torch 2.11-2.13
    _alias = _alias_fallback


def allocator(device: torch.device) -> Callable:
    """`empty(size, stride, dtype)` on the graph's device, sizes and strides as tuples.

    torch's C++ helpers for this (what Inductor's host code calls) skip the Python argument
    parser: 0.45 vs 1.1 us on the CPU machine; `torch.empty_strided` takes 4.7 us on the H100
    machine's host, and ResNet-50's training step allocates 556
    times. The CUDA helper allocates on the current device: it is used only when that is the
    graph's at compile time, the assumption the backend's direct launches make too."""
    helpers = getattr(torch._C._dynamo, "guards", None)
    fast = None
    if device.type == "cpu":
        fast = getattr(helpers, "_empty_strided_cpu", None)
    elif device.type == "cuda" and torch.cuda.is_available() and device.index in (None, torch.cuda.current_device()):
        fast = getattr(helpers, "_empty_strided_cuda", None)
    if fast is not None:
        return fast

    def empty(size: tuple, stride: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return empty


def _may_be_huge(v: Value) -> bool:
    """Whether `v`'s buffer can reach huge_pages.MIN_BYTES (a symbolic size may: checked per call)."""
    extent = 1 + sum((n - 1) * st for n, st in zip(v.shape, layout_of(v)))
    if not isinstance(extent, int) and not getattr(extent, "is_number", False):
        return True
    return int(extent) * v.dtype.itemsize >= MIN_BYTES


def _fix_layout(t: torch.Tensor, size: tuple, stride: tuple) -> torch.Tensor:
    """Kernels index extern results (and a backward graph's inputs) with the strides the compile-time
    meta promised; enforce them."""
    if t is not None and t.shape == size and t.stride() == stride:
        return t  # the common case, checked first: this runs once per extern per call
    if t is None or tuple(t.shape) != tuple(size):
        raise RuntimeError(
            f"an extern returned {None if t is None else tuple(t.shape)} where its meta promised {tuple(size)}"
        )
    if all(st == want or sz <= 1 for sz, st, want in zip(t.shape, t.stride(), stride)):
        return t
    out = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out


class HostWriter:
    def __init__(self, schedule: Schedule, launcher: Any, check_input_layouts: bool):
        self.schedule = schedule
        self.graph = schedule.graph
        self.launcher = launcher
        self.allocated: set[str] = set()  # names bound to memory this program allocated (aligned)
        self.tensor_of: dict[str, str] = {}  # name -> the name first bound to the same tensor object
        self.lines: list[str] = []
        self.names: dict[int, str] = {}  # Value.id -> Python variable
        self.ns: dict[str, Any] = {
            "torch": torch,
            "_fix_layout": _fix_layout,
            "_alias": _alias,
        }
        self.device = self.graph.device
        self.plan: MemoryPlan = schedule.memory
        self.check_input_layouts = check_input_layouts
        self.stride_symbols: set = set()  # symbols bound from an input's strides (_bind_symbols)
        # Inputs the graph writes: kept to the end, where those not written in place are copied into.
        self.mutated = {inp for inp, _ in self.graph.mutations}
        # Donors whose memory a later buffer takes: that buffer's line drops the old name.
        self.handed_over = {d for v, d in self.plan.reuse.items() if v not in self.plan.inplace}
        # Values whose memory layout must be the one the compile-time meta promised: kernels index
        # them with those strides, and aliases are made with them. An extern can return another
        # layout than its meta (its inputs' layouts may differ from tracing); those get copied.
        self.layout_sensitive: set[Value] = {v for k in schedule.kernels for v in k.reads}
        self.layout_sensitive |= {s.base for s in schedule.steps if isinstance(s, AliasStep)}
        # Value id -> (strides, enforced): the layout each bound tensor has at run time. Enforced:
        # this program made it so (allocated, aliased, or checked by _fix_layout); else it is the
        # compile-time meta's, which an extern specialized on it checks per call.
        self.layouts: dict[int, tuple[tuple, bool]] = {}

    def py(self, expr: Expr) -> str:
        return print_host_index(sympy.sympify(expr))

    def constant(self, obj: Any) -> str:
        if isinstance(obj, float) and not math.isfinite(obj):
            return f"float('{obj}')"
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return repr(obj)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            return repr(obj)  # torch.float32, torch.contiguous_format: `torch` is in the namespace
        name = _constant_name(obj, len(self.ns))
        self.ns[name] = obj
        return name

    def arg(self, x: Any) -> str:
        if isinstance(x, Value):
            return self.names[x.id]
        if isinstance(x, sympy.Expr):
            return self.py(x)
        if isinstance(x, sympy.logic.boolalg.Boolean):
            return self.condition(x)
        if isinstance(x, (list, tuple)):
            inner = ", ".join(self.arg(a) for a in x)
            return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k!r}: {self.arg(v)}" for k, v in x.items()) + "}"
        return self.constant(x)

    def condition(self, c: Any) -> str:
        """A condition over sizes (a size check, a branch predicate over sizes) as a Python expression."""
        if c in (sympy.true, sympy.false):
            return repr(bool(c))
        if isinstance(c, sympy.core.relational.Relational):
            return f"({self.py(c.lhs)} {c.rel_op} {self.py(c.rhs)})"
        if isinstance(c, sympy.Not):
            return f"(not {self.condition(c.args[0])})"
        if isinstance(c, (sympy.And, sympy.Or)):
            word = " and " if isinstance(c, sympy.And) else " or "
            return "(" + word.join(self.condition(a) for a in c.args) + ")"
        raise NotImplementedError(f"condition {c}")

    def write(self) -> HostProgram:
        g = self.graph
        steps = self.schedule.steps
        self.ns["device"] = self.device
        self.ns["empty"] = allocator(self.device)
        huge = huge_allocator(self.ns["empty"]) if self.device.type == "cpu" and config.get("cpu_huge_pages") else None
        if self.device.type == "cpu":
            heap.retain(config.get("cpu_heap_retain_mb"))
        if huge is not None:
            self.ns["empty_huge"] = huge
        ranges = config.get("profile_ranges")  # a profiler range named after each kernel launch
        if ranges:
            self.ns["_profiler_range"] = torch.profiler.record_function
        self.lines.append("def call(args):")
        params = []
        for k, inp in enumerate(g.inputs):
            name = f"a{k}"
            params.append(name)
            if isinstance(inp, Value):
                self.names[inp.id] = name
                self.layouts[inp.id] = (tuple(layout_of(inp)), False)
        if params:
            self.lines.append(f"    {', '.join(params)}{',' if len(params) == 1 else ''} = args")
            # AOTAutograd's boxed convention: the list is ours to empty, so an input (a backward's
            # saved activation) is freed at its last use here, not when the whole program returns.
            self.lines.append("    args.clear()")
        self._bind_symbols()
        self._fix_input_layouts()
        self.lines += [f"    {line}" for line in self.launcher.prologue()]
        last_use = self._last_uses()
        dying: dict[int, list[Value]] = {}  # step -> the values it is the last to use, in last_use order
        for v, p in last_use.items():
            dying.setdefault(p, []).append(v)
        outputs = {o for o in g.outputs if isinstance(o, Value)}
        for pos, step in enumerate(steps):
            if isinstance(step, KernelStep):
                parts = kernel_parts(step.kernel)
                scalars = [sym for part in parts for sym in part.size_symbols()]  # its size and scalar parameters
                self._require_bound([*step.kernel.reads, *step.kernel.writes, *scalars], step.kernel.name)
                added = {s.buffer: s.initial for part in parts for s in part.stores if s.accumulate}
                for v in step.kernel.writes:
                    self._allocate(v)
                    if v in added:  # a scatter-add adds into its initial value (schedule/indexed_store.py)
                        initial = added[v]
                        fill = "zero_()" if initial is None else f"copy_({self.names[initial.id]})"
                        self.lines.append(f"    {self.names[v.id]}.{fill}")
                if step.kernel.writes_nothing:
                    self.lines.append(f"    # {step.kernel.name}: every output is empty, nothing to launch")
                else:
                    buffers = [self.names[v.id] for v in _kernel_buffers(step.kernel)]
                    first: dict[str, str] = {}
                    for b in buffers:
                        first.setdefault(self.tensor_of.get(b, b), b)
                    args = {
                        "buffers": buffers,
                        "maybe_unaligned": [b for b in buffers if b not in self.allocated],
                        "same": [first[self.tensor_of.get(b, b)] for b in buffers],
                    }
                    launch = self.launcher.launch_line(step.kernel, args)
                    if ranges:
                        self.lines.append(f"    with _profiler_range({step.kernel.name!r}):")
                        launch = f"    {launch}"
                    self.lines.append(f"    {launch}")
            elif isinstance(step, ExternStep):
                self._extern(step)
            elif isinstance(step, AliasStep):
                name = f"v{step.value.id}"
                self.names[step.value.id] = name
                self.layouts[step.value.id] = (tuple(step.stride), True)
                size, stride = self.arg(tuple(step.value.shape)), self.arg(tuple(step.stride))
                self.lines.append(
                    f"    {name} = _alias({self.names[step.base.id]}, {size}, {stride}, {self.py(step.offset)})"
                )
            for v in dying.get(pos, ()):
                if v.id in self.names and v not in outputs and v not in self.handed_over and v not in self.mutated:
                    # Python frees the memory when no view of it remains (an input: when the caller
                    # holds it no more either).
                    self.lines.append(f"    del {self.names[v.id]}")
        for inp, pos in g.mutations:
            if inp not in self.plan.mutations_in_place:  # else a kernel or extern wrote it there
                self.lines.append(f"    {self.names[inp.id]}.copy_({self._output(g.outputs[pos])})  # input mutation")
        outs = ", ".join(self._output(o) for o in g.user_outputs())
        self.lines.append(f"    return [{outs}]")
        return HostProgram("\n".join(self.lines) + "\n", self.ns, self._table_inputs(len(params)))

    def _table_inputs(self, count: int) -> frozenset[int]:
        """The inputs (a0, a1, ...) this program names, under their own name or one bound to the same
        tensor (`buf7 = a3  # in place`), only in table launches (and in its unpacking, `del` and
        binding lines): any other mention, a kernel's argument, an extern's, an alias's base, a size
        read, a copy, an output, may take the tensor's address or contents directly."""
        if not count:
            return frozenset()
        assert self.lines[1].strip().endswith("= args"), self.lines[1]  # the unpacking, skipped below
        tabled: set[str] = set()
        direct: set[str] = set()
        for line in self.lines[2:]:
            text = line.strip()
            if text.startswith("del ") or text == "args.clear()" or _BINDING.fullmatch(text):
                continue
            names = {self.tensor_of.get(n, n) for n in _IDENTIFIER.findall(text)}
            (tabled if text.startswith("_tables_") else direct).update(names)
        inputs = {f"a{k}": k for k in range(count)}
        return frozenset(inputs[n] for n in tabled - direct if n in inputs)

    def _output(self, o: Any) -> str:
        if isinstance(o, Value):
            return self.names[o.id]
        if isinstance(o, sympy.Expr):
            return self.py(o)
        return self.constant(o)

    def _fix_input_layouts(self) -> None:
        """Inputs kernels index (or alias) with the recorded strides: copied into them if they
        arrive otherwise (a backward graph's saved tensors, a cond branch's operands computed by the
        graph around it). Symbolic strides too, where they are expressions of the sizes (a transposed
        [s0, s1] as (1, s0)); a stride read off an input as it comes is its own, nothing to fix."""
        if not self.check_input_layouts:
            return
        for k, inp in enumerate(self.graph.inputs):
            if not isinstance(inp, Value) or inp not in self.layout_sensitive or inp.stride is None:
                continue
            if inp in self.mutated:
                # A copy in the promised layout would take the writes, not the caller's tensor.
                raise NotImplementedError("a mutated input whose layout the program would have to fix")
            if not any(sympy.sympify(e).free_symbols & self.stride_symbols for e in inp.stride):
                size, stride = self.arg(tuple(inp.shape)), self.arg(tuple(inp.stride))
                self.lines.append(f"    a{k} = _fix_layout(a{k}, {size}, {stride})")
                self.layouts[inp.id] = (tuple(inp.stride), True)

    def _bind_symbols(self) -> None:
        """Every size symbol, read off the first input that carries it."""
        bound: set = set()
        for k, inp in enumerate(self.graph.inputs):
            if isinstance(inp, sympy.Symbol) and inp not in bound:
                self.lines.append(f"    {inp.name} = a{k}")
                bound.add(inp)
        for k, inp in enumerate(self.graph.inputs):
            if not isinstance(inp, Value):
                continue
            for d, size in enumerate(inp.shape):
                if isinstance(size, sympy.Symbol) and size not in bound:
                    self.lines.append(f"    {size.name} = a{k}.size({d})")
                    bound.add(size)
            for d, stride in enumerate(inp.stride or ()):
                if isinstance(stride, sympy.Symbol) and stride not in bound:
                    self.lines.append(f"    {stride.name} = a{k}.stride({d})")
                    bound.add(stride)
                    self.stride_symbols.add(stride)
        needed = set()
        for v in self.graph.values():
            for e in list(v.shape) + list(v.stride or ()):
                needed |= sympy.sympify(e).free_symbols
        self.bound = bound
        # A size that depends on data (nonzero's row count: an unbacked symbol) is bound where the extern
        # producing it returns, from its result; kernels and allocations after it read the variable.
        missing = needed - bound - self._extern_symbols()
        if missing:
            raise NotImplementedError(f"cannot bind sizes {sorted(map(str, missing))} from the graph inputs")

    def _extern_symbols(self) -> set:
        """Symbols an extern's result carries as a whole size or stride (bound from that result)."""
        found = set()
        for step in self.schedule.steps:
            if isinstance(step, ExternStep):
                for v in step.node.outputs:
                    found |= {e for e in (*v.shape, *(v.stride or ())) if isinstance(e, sympy.Symbol)}
        return found

    def _require_bound(self, things: list, step: str) -> None:
        """Every size symbol a step reads is bound before it (a data-dependent size only after the extern
        whose result carries it); checked here, at compile time, not as a NameError in the first call."""
        found: set = set()

        def walk(x: Any) -> None:
            if isinstance(x, Value):
                for e in (*x.shape, *(x.stride or ())):
                    found.update(sympy.sympify(e).free_symbols)
            elif isinstance(x, sympy.Basic):
                found.update(x.free_symbols)
            elif isinstance(x, (list, tuple)):
                for y in x:
                    walk(y)
            elif isinstance(x, dict):
                for y in x.values():
                    walk(y)

        walk(things)
        unbound = found - self.bound
        if unbound:
            raise NotImplementedError(f"{step} reads sizes {sorted(map(str, unbound))} before they are known")

    def _bind_result_symbols(self, v: Value, name: str) -> None:
        """Bind the symbols first seen in an extern result's sizes and strides (data-dependent sizes)."""
        for what, exprs in (("size", v.shape), ("stride", v.stride or ())):
            for d, e in enumerate(exprs):
                if isinstance(e, sympy.Symbol) and e not in self.bound:
                    self.lines.append(f"    {e.name} = {name}.{what}({d})")
                    self.bound.add(e)

    def _last_uses(self) -> dict[Value, int]:
        last: dict[Value, int] = {}
        for pos, step in enumerate(self.schedule.steps):
            if isinstance(step, KernelStep):
                used = list(step.kernel.reads) + step.kernel.writes
            elif isinstance(step, ExternStep):
                used = step.node.value_inputs() + step.node.outputs
            else:
                used = [step.base, step.value]
            for v in used:
                last[v] = pos
        return last

    def _allocate(self, v: Value) -> None:
        name = f"buf{v.id}"
        self.names[v.id] = name
        self.layouts[v.id] = (tuple(layout_of(v)), True)
        size, stride = self.arg(tuple(v.shape)), self.arg(tuple(layout_of(v)))
        donor = self.plan.reuse.get(v)
        if donor is None:
            alloc = "empty_huge" if "empty_huge" in self.ns and _may_be_huge(v) else "empty"
            self.lines.append(f"    {name} = {alloc}({size}, {stride}, {self.constant(v.dtype)})")
            self.allocated.add(name)
            return
        old = self.names[donor.id]
        if old in self.allocated:  # reuse starts at the donor's first byte
            self.allocated.add(name)
        how = "in place" if v in self.plan.inplace else "reuse"
        if same_layout(donor, v):
            self.lines.append(f"    {name} = {old}  # {how}")
            self.tensor_of[name] = self.tensor_of.get(old, old)
        else:
            self.lines.append(f"    {name} = _alias({old}, {size}, {stride}, 0)  # {how}")
        if donor in self.handed_over:
            self.lines.append(f"    del {old}")

    def _extern(self, step: ExternStep) -> None:
        node = step.node
        target = node.attrs["target"]
        self._require_bound([node.attrs["args"], node.attrs["kwargs"], *node.value_inputs()], node.origin)
        if node.attrs.get("writes_input") in self.plan.mutations_in_place:
            target = node.attrs["inplace_target"]  # a scatter into the input itself (memory plan)
        call = self._extern_call(target, node.attrs["args"], node.attrs["kwargs"])
        dense = _dense_result(target)
        if not node.attrs["tuple_result"]:
            if node.outputs:
                self._bind_extern_output(node.outputs[0], call, dense)
            else:  # called for its effect: _assert_async (one_hot's range checks)
                self.lines.append(f"    {call}")
            return
        result = f"r{node.outputs[0].id}" if node.outputs else "_"
        self.lines.append(f"    {result} = {call}")
        # A target whose results are fresh row-major tensors (grouped skinny products) promises their layout.
        dense = target if getattr(target, "row_major_results", False) else None
        for pos, v in zip(node.attrs["output_positions"], node.outputs):
            self._bind_extern_output(v, f"{result}[{pos}]", dense)
        if node.outputs:
            self.lines.append(f"    del {result}")  # the tuple would keep every result alive

    def _extern_call(self, target: Any, args, kwargs: dict) -> str:
        """The call expression. A target that decides from its operands' layouts (`specialize`:
        an aligned product) is decided here, once; an operand whose layout this program does not
        enforce (an input, an unchecked extern result) keeps one stride check per call, and a
        layout other than the meta's takes the undecided target."""
        text = self._call_args(args, kwargs)
        fixed = self._specialized(target, args)
        if fixed is None:
            return f"{self._callee(target, kwargs)}({text})"
        fn, checks = fixed
        fast = f"{self._callee(fn, kwargs)}({text})"
        if not checks:
            return fast
        return f"({fast} if {' and '.join(checks)} else {self.constant(target)}({text}))"

    def _specialized(self, target: Any, args) -> tuple[Any, list[str]] | None:
        specialize = getattr(target, "specialize", None)
        if specialize is None:
            return None
        fn = specialize([self._static_layout(a) for a in args])
        if fn is None:
            return None
        checks = []
        for pos in target.layout_args:
            a = args[pos]
            if isinstance(a, Value) and not self.layouts[a.id][1]:
                checks.append(f"{self.names[a.id]}.stride() == {self.arg(self.layouts[a.id][0])}")
        return fn, checks

    def _static_layout(self, a: Any) -> tuple | None:
        """(shape, strides, dtype) of an argument bound here with a static layout, else None."""
        if not isinstance(a, Value) or a.id not in self.layouts:
            return None
        stride = self.layouts[a.id][0]
        if not all(sympy.sympify(e).is_Integer for e in (*a.shape, *stride)):
            return None
        return tuple(int(x) for x in a.shape), tuple(int(x) for x in stride), a.dtype

    def _callee(self, target: Any, kwargs: dict) -> str:
        """The name the program calls: torch's function for a product, an ATen overload's C++
        entry (`OpOverload.__call__` is a Python frame that only calls it: 0.3 us a call)."""
        target = _fast_target(target, kwargs)
        if type(target) is torch._ops.OpOverload:
            name = _constant_name(target, len(self.ns))
            self.ns[name] = target._op
            return name
        return self.constant(target)

    def _call_args(self, args, kwargs: dict) -> str:
        """`a, b, key=c`: spelled out, a call skips building a tuple and a dict to unpack (0.25 us
        of a 5 us ATen call on the CPU machine). A keyword Python reserves (aten's `from`) goes
        through `**{...}`."""
        parts = [self.arg(a) for a in args]
        plain = {k: v for k, v in kwargs.items() if k.isidentifier() and not keyword.iskeyword(k)}
        parts += [f"{k}={self.arg(v)}" for k, v in plain.items()]
        rest = {k: v for k, v in kwargs.items() if k not in plain}
        if rest:
            parts.append(f"**{self.arg(rest)}")
        return ", ".join(parts)

    def _bind_extern_output(self, v: Value, src: str, dense: Any) -> None:
        """`dense`: the product whose contract gives its result the meta's layout, or None."""
        name = f"buf{v.id}"
        self.names[v.id] = name
        if any(isinstance(e, sympy.Symbol) and e not in self.bound for e in (*v.shape, *(v.stride or ()))):
            self.lines.append(f"    {name} = {src}")
            self._bind_result_symbols(v, name)
            src = name
        # ATen's products return a fresh row-major tensor at every size, so their layout holds with
        # symbolic sizes too; an aligned product's padded rows are promised where the sizes are static.
        static = all(sympy.sympify(e).is_Integer for e in (*v.shape, *layout_of(v)))
        promised = dense is not None and (static or not isinstance(dense, AlignedProduct))
        if promised and not isinstance(dense, AlignedProduct):  # ATen's products: row-major
            promised = tuple(layout_of(v)) == tuple(contiguous_strides(v.shape))
        self.layouts[v.id] = (tuple(layout_of(v)), promised or v in self.layout_sensitive)
        if v in self.layout_sensitive and not promised:
            self.lines.append(
                f"    {name} = _fix_layout({src}, {self.arg(tuple(v.shape))}, {self.arg(tuple(v.stride))})"
            )
        else:  # only ATen reads it (or nobody: e.g. a logsumexp that inference never computes)
            self.lines.append(f"    {name} = {src}")


def _dense_result(target: Any) -> Any:
    """What promises an extern's result layout, or None: ATen's products return a fresh row-major
    tensor, and an aligned product the (padded) rows the padding pass set."""
    return target if target in _DENSE_PRODUCTS or isinstance(target, AlignedProduct) else None


def _kernel_buffers(kernel) -> list[Value]:
    seen: dict[int, Value] = {}
    for v in list(kernel.reads) + kernel.writes:
        seen.setdefault(v.id, v)
    return list(seen.values())


def write_host(schedule: Schedule, launcher, check_input_layouts: bool = False) -> HostProgram:
    return HostWriter(schedule, launcher, check_input_layouts).write()
