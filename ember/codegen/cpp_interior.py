"""Window interiors on the C++ target: the positions where a window's bounds hold, computed apart.

A window that reads past an image's edge (a depthwise convolution's taps, a padded max pool, a constant
pad fused into its reader) is a `where` over bounds checks of the output position, and a load whose
index is clamped into the image:

    bool inside = (l0 - 1 >= 0) & (l0 - 1 < 112) & (l1 - 1 >= 0) & ...
    float tap = ember_pick(inside, x[c + 32 * clamp(l1 - 1) + 3584 * clamp(l0 - 1)], 0.0f)

Along the vector loop (the channels of a channels-last image) the checks do not change, but each of the
window's taps still computes them, clamps its index and selects, per pixel. Nearly every pixel is inside
every window: for them the checks are true and the clamps change nothing. So where the bounds are affine
in one loop variable each, the kernel gets a box of the outer loop variables in which every such check
holds (`interior`), and the renderer (codegen/cpp.py) writes the vector loop twice: for the box, with the
checks folded to constants and the clamps dropped (`Interior`), and elsewhere as before.

Inside the box, the innermost outer loop (a row's pixels) also runs in blocks of `jam` positions, one
vector loop computing them together, where that saves loads: a depthwise convolution's weights are
read once for the block, not once a pixel. A window with no bounds to check (its input padded by
another kernel) gets the blocks alone:

    for (l0 ...) for (l1_block ...)
        if (l0 >= 1 && l0 < 111 && l1_start >= 1 && l1_start + 4 <= 111) { one vector loop, 4 pixels }
        else for (l1 in the block) { vector loop, as before }

On the 2-core AMD machine, the kernel of a depthwise 3x3 over 32 channels at 112x112 with its batch norm
and ReLU6, called alone, took 234 us in one body and 95 us with the interior apart; code of the same form
over 144 channels at 56x56 took 118 us a pixel at a time and 71 us four at a time (whole compiled calls:
decisions.md). Every position computes the same operations in the same order as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import sympy
import torch

from ember.codegen.render import print_index
from ember.ir import ops
from ember.schedule.kernel import KConst, KConvert, KIndex, KLoad, KNode, KOp

_COMPARISONS = ("ge", "gt", "le", "lt")
_BOOLEAN = ("logical_and", "logical_or", "logical_not", "bitwise_and", "bitwise_or")


def _integral(dtype: torch.dtype) -> bool:
    return dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)


@dataclass
class Interior:
    """The box (each outer variable's [lo, hi) where it is narrower than its loop) and what the kernel's
    nodes are inside it: `facts` maps a node's id to its constant value there, `ranges` holds each loop
    variable's bounds (inclusive) there. The innermost outer loop (`var`) runs in blocks of `jam`
    positions from `origin` (a block starts where the box does); `fixed` holds the ids of the nodes that
    do not read `var`, computed once for a block's positions."""

    box: dict[sympy.Symbol, tuple[int, int]]
    facts: dict[int, int]
    ranges: dict[sympy.Symbol, tuple[int, int]]
    var: sympy.Symbol
    jam: int
    origin: int
    fixed: frozenset[int]
    _indices: dict = field(default_factory=dict, repr=False)  # (expr, shift) -> index, written once a kernel

    def condition(self, start: str) -> str:
        """The C++ test that a block starting at `start` lies in the box, as do the other outer variables."""
        lo, hi = self.box.get(self.var, (0, self.ranges[self.var][1] + 1))
        tests = [f"{v.name} >= {a} && {v.name} < {b}" for v, (a, b) in self.box.items() if v != self.var]
        if self.origin < lo:  # blocks start at origin, origin + jam, ...: the first ones before the box
            tests.append(f"{start} >= {lo}")
        tests.append(f"{start} + {self.jam} <= {hi}")
        return " && ".join(tests)

    def index(self, expr, shift: int = 0):
        """`expr` without the clamps (Min, Max) that the box decides, at position `shift` of a block."""
        key = (expr, shift)
        if key not in self._indices:
            plain = simplify_clamps(expr, self.ranges)
            self._indices[key] = plain.subs(self.var, self.var + shift) if shift else plain
        return self._indices[key]


class WindowInteriors:
    """Mixed into the C++ renderer (codegen/cpp.py: CppRenderer), whose emission, loop dims and picks it
    uses (`emit`, `body`, `names`, `_dims`, `_picks`, `h`: its CppHeuristics): the loops and bodies of a
    kernel with an interior, and how nodes and indices read inside it (`_interior`, `_shift`)."""

    # While the body of a window's interior is written: what is known there, and which position of the
    # interior's block (Interior.jam) is written. Set on the instance for the duration of that body.
    _interior: Interior | None = None
    _shift = 0

    def _index(self, expr):
        """An index over the loop variables; inside a window's interior, without the clamps it decides,
        at the block's position `_shift`."""
        expr = self.kernel.index(expr)
        return self._interior.index(expr, self._shift) if self._interior is not None else expr

    def emit_node(self, node: KNode) -> None:
        """As Renderer's, but inside a window's interior a node whose value the box decides is that
        constant, and a `where` whose condition it decides is the operand it picks (neither emits what
        it would have read)."""
        inner = self._interior
        if inner is None or id(node) in self.names or isinstance(node, KConst):
            return super().emit_node(node)
        t = self.ctype(node.dtype)
        if id(node) in inner.facts:
            value = self.const(KConst(node.dtype, node.full, node.ready, inner.facts[id(node)]))
        elif isinstance(node, KOp) and node.fn == "where" and id(node.operands[0]) in inner.facts:
            chosen = node.operands[1] if inner.facts[id(node.operands[0])] else node.operands[2]
            self.emit_node(chosen)
            value = f"static_cast<{t}>({self.ref(chosen)})"
        else:
            return super().emit_node(node)
        name = self.fresh()
        self.names[id(node)] = name
        self.emit(f"{t} {name} = {value};")

    def _window_interior(self) -> Interior | None:
        """The box where a pointwise kernel's window bounds hold (cpp_interior.py), for a kernel of
        several outer loops whose checks do not change along its vector loop; None elsewhere."""
        if self.checks_rows or not self.h.window_interiors:
            return None
        picks = [n for n in self.nodes if self._picks(n)]
        return interior(self.nodes, self.kernel.index, self._dims(reduce=False), picks, self.h.window_jam)

    def _interior_and_rest(self, inner: Interior, jammed: tuple, vector: tuple) -> None:
        """The innermost outer loop in blocks of `inner.jam` positions: a block inside the box runs one
        vector loop computing its positions together, with what the box decides folded (the values that
        do not change along the block's loop, such as a window's weights, read once for all of them);
        any other block runs the vector loop as it is, a position at a time."""
        v, size = jammed
        p, origin = inner.jam, inner.origin
        blocks = -(-(int(size) - origin) // p)
        start = f"{v.name}_start"
        self.emit(f"for (int64_t {v.name}_block = 0; {v.name}_block < {blocks}; {v.name}_block++) {{")
        self.indent += 1
        self.emit(f"const int64_t {start} = {origin} + {v.name}_block * {p};")
        saved = dict(self.names)
        self.emit(f"if ({inner.condition(start)}) {{")
        self.indent += 1
        self.emit(f"const int64_t {v.name} = {start};")
        self._vector_loop(vector, inner, saved)
        self.indent -= 1
        self.emit("} else {")
        self.indent += 1
        first, last = f"std::max<int64_t>({start}, 0)", f"std::min<int64_t>({start} + {p}, {int(size)})"
        self.emit(f"for (int64_t {v.name} = {first}; {v.name} < {last}; {v.name}++) {{")
        self.indent += 1
        self._vector_loop(vector, None, saved)
        self.indent -= 1
        self.emit("}")
        self.indent -= 1
        self.emit("}")
        self.indent -= 1
        self.emit("}")
        self.names = saved

    def _vector_loop(self, vector: tuple, inner: Interior | None, names: dict) -> None:
        """The vector loop over the kernel's body: as it is (`inner` None), or inside the box, once per
        position of a block (the block's variable shifted by each; what does not read it, once)."""
        v, s = vector
        self.emit("#pragma omp simd")
        self.emit(f"for (int64_t {v.name} = 0; {v.name} < {print_index(s, '/')}; {v.name}++) {{")
        self.indent += 1
        self.names = dict(names)
        if inner is None:
            self.body()
        else:
            for offset in range(inner.jam):  # what copy 0 named and does not read the block's variable is kept
                self._interior, self._shift = inner, offset
                self.names = {**names, **{k: n for k, n in self.names.items() if k in inner.fixed}}
                self.body()
            self._interior, self._shift = None, 0
        self.indent -= 1
        self.emit("}")


def interior(
    nodes: list[KNode], index, loops: list[tuple[sympy.Symbol, object]], picks: list[KOp], jam: int = 1
) -> Interior | None:
    """The box of a pointwise kernel's outer loop variables (all of `loops` but the last, the vector loop)
    where the bounds checks under its `picks` (`where`s whose condition the vector loop does not change)
    hold, if some fold there and the box is not empty; `index` maps a node's expression to the loop
    variables'. Sizes must be static. The innermost outer loop runs in blocks of `jam` positions (1 where
    the box holds fewer). A window without bounds checks (over an input padded beforehand) gets blocks
    over the whole loop, and no box."""
    if len(loops) < 2 or not all(s.is_Integer for _, s in loops):
        return None
    full = {v: (0, int(s) - 1) for v, s in loops}
    outer = [v for v, _ in loops[:-1]]
    var = outer[-1]
    found = _box(nodes, index, outer, full, picks)
    if found is None and not _window(nodes, index, var):
        return None  # nearly every kernel: no window, nothing more to look at
    fixed = _not_reading(nodes, index, var)
    jam = max(1, jam) if _jam_pays(nodes, index, fixed, loops[-1][0]) else 1
    if found is None:
        if jam < 2 or full[var][1] + 1 < jam:
            return None
        return Interior({}, {}, full, var, jam, 0, fixed)
    box, facts, ranges = found
    lo, hi = box.get(var, (0, full[var][1] + 1))
    jam = jam if hi - lo >= jam else 1
    origin = lo % jam - jam if lo % jam else 0
    return Interior(box, facts, ranges, var, jam, origin, fixed)


def _box(nodes, index, outer, full, picks) -> tuple[dict, dict, dict] | None:
    """(box, facts, ranges) for the picks' bounds checks (Interior), or None where no check folds."""
    if not picks:
        return None
    bounds = {v: [0, full[v][1] + 1] for v in outer}
    for atom in _atoms(picks):
        found = _bound(atom, index, outer)
        if found is None:
            continue
        var, lo, hi = found
        bounds[var][0] = max(bounds[var][0], lo)
        bounds[var][1] = min(bounds[var][1], hi)
    box = {v: (lo, hi) for v, (lo, hi) in bounds.items() if (lo, hi) != (0, full[v][1] + 1)}
    if not box or any(lo >= hi for lo, hi in box.values()):
        return None
    ranges = dict(full)
    ranges.update({v: (lo, hi - 1) for v, (lo, hi) in box.items()})
    facts = _constants(nodes, index, ranges)
    if not any(id(p.operands[0]) in facts for p in picks):
        return None
    return box, facts, ranges


def _jam_pays(nodes: list[KNode], index, fixed: frozenset[int], vector: sympy.Symbol) -> bool:
    """Whether computing a block's positions together saves loads: something read along the vector loop
    does not change along the block's (a depthwise convolution's weights), and what each position
    computes holds no transcendental op (a SiLU's exp after the taps: its registers and latency, not the
    loads, bound the loop, and on the 2-core machine four positions at a time ran up to 10% slower)."""
    shared = any(isinstance(n, KLoad) and id(n) in fixed and vector in index(n.index).free_symbols for n in nodes)
    costly = any(
        isinstance(n, KOp) and id(n) not in fixed and n.fn in ops.POINTWISE and ops.POINTWISE[n.fn].flops >= 4
        for n in nodes
    )
    return shared and not costly


def _window(nodes: list[KNode], index, var: sympy.Symbol) -> bool:
    """Whether the kernel reads a window along `var`: one buffer at two indices a constant apart, at least
    one of which moves with `var` (a convolution's or a pool's taps)."""
    by_buffer: dict[int, list] = {}
    for n in nodes:
        if isinstance(n, KLoad) and not n.rows:
            expr = index(n.index)
            if var in expr.free_symbols:
                by_buffer.setdefault(id(n.buffer), []).append(expr)
    for exprs in by_buffer.values():
        for i, a in enumerate(exprs):
            if any(a != b and (a - b).is_Integer for b in exprs[i + 1 :]):
                return True
    return False


def _not_reading(nodes: list[KNode], index, var: sympy.Symbol) -> frozenset[int]:
    """The ids of the nodes whose value does not depend on loop variable `var`."""
    reads: dict[int, bool] = {}

    def depends(n: KNode) -> bool:
        if id(n) not in reads:
            own = False
            if isinstance(n, KLoad):
                own = var in index(n.index).free_symbols
            elif isinstance(n, KIndex):
                own = var in index(n.expr).free_symbols
            reads[id(n)] = own or any(depends(a) for a in n.args())
        return reads[id(n)]

    return frozenset(id(n) for n in nodes if not depends(n))


def _atoms(picks: list[KOp]) -> list[KOp]:
    """The comparisons that the picks' conditions combine (through and/or/not and bool conversions)."""
    atoms, seen, stack = [], set(), [p.operands[0] for p in picks]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n, KOp) and n.fn in _COMPARISONS:
            atoms.append(n)
        elif isinstance(n, KOp) and n.fn in _BOOLEAN or isinstance(n, KConvert):
            stack.extend(n.args())
    return atoms


def _affine(node: KNode, index) -> tuple[dict, int] | None:
    """node as an integer affine function of loop variables ({var: coefficient}, constant), or None."""
    if isinstance(node, KConst) and _integral(node.dtype) and node.dtype != torch.bool:
        return {}, int(node.value)
    if isinstance(node, KIndex) and not node.rows:
        expr = sympy.expand(index(node.expr))
        coeffs = {}
        constant = 0
        for term, c in expr.as_coefficients_dict().items():
            if not c.is_Integer:
                return None
            if term == 1:
                constant += int(c)
            elif isinstance(term, sympy.Symbol):
                coeffs[term] = coeffs.get(term, 0) + int(c)
            else:
                return None
        return coeffs, constant
    if isinstance(node, KConvert) and _integral(node.dtype) and node.dtype != torch.bool:
        return _affine(node.arg, index) if _integral(node.arg.dtype) and node.arg.dtype != torch.bool else None
    if isinstance(node, KOp) and node.fn in ("add", "sub", "mul", "neg") and _integral(node.dtype):
        parts = [_affine(a, index) for a in node.operands]
        if any(p is None for p in parts):
            return None
        if node.fn == "neg":
            ((c, k),) = parts
            return {v: -x for v, x in c.items()}, -k
        (ca, ka), (cb, kb) = parts
        if node.fn == "mul":
            if ca and cb:
                return None
            scale, (c, k) = (kb, (ca, ka)) if not cb else (ka, (cb, kb))
            return {v: x * scale for v, x in c.items()}, k * scale
        sign = 1 if node.fn == "add" else -1
        coeffs = dict(ca)
        for v, x in cb.items():
            coeffs[v] = coeffs.get(v, 0) + sign * x
        return coeffs, ka + sign * kb
    return None


def _bound(atom: KOp, index, outer: list) -> tuple[sympy.Symbol, int, int] | None:
    """(var, lo, hi): the values [lo, hi) of the one outer variable for which the comparison holds, where
    it compares an affine function of that variable alone with a constant."""
    sides = [_affine(a, index) for a in atom.operands]
    if any(s is None for s in sides):
        return None
    (ca, ka), (cb, kb) = sides
    coeffs = {v: ca.get(v, 0) - cb.get(v, 0) for v in set(ca) | set(cb)}
    coeffs = {v: c for v, c in coeffs.items() if c}
    if len(coeffs) != 1:
        return None
    ((var, c),) = coeffs.items()
    if var not in outer:
        return None
    d = ka - kb  # the comparison is c * var + d (op) 0
    op = atom.fn
    if op in ("gt", "le"):  # x > 0 is x >= 1; x <= 0 is x < 1
        d, op = (d - 1, "ge") if op == "gt" else (d - 1, "lt")
    big = 1 << 62
    if op == "ge":  # c * var >= -d
        return (var, math.ceil(-d / c), big) if c > 0 else (var, -big, math.floor(-d / c) + 1)
    # lt: c * var < -d
    return (var, -big, math.ceil(-d / c)) if c > 0 else (var, math.floor(-d / c) + 1, big)


def _constants(nodes: list[KNode], index, ranges: dict) -> dict[int, int]:
    """The integer and bool nodes whose value `ranges` decides: id -> value."""
    memo: dict[int, tuple[int, int] | None] = {}

    def rng(n: KNode) -> tuple[int, int] | None:
        if id(n) not in memo:
            memo[id(n)] = _range(n, index, ranges, rng) if _integral(n.dtype) else None
        return memo[id(n)]

    facts = {}
    for n in nodes:
        r = rng(n)
        if r is not None and r[0] == r[1] and not isinstance(n, KConst):
            facts[id(n)] = r[0]
    return facts


def _range(n: KNode, index, ranges: dict, rng) -> tuple[int, int] | None:
    """[lo, hi] (inclusive) of an integer or bool node over `ranges`, or None where unknown."""
    if isinstance(n, KConst):
        v = int(n.value)
        return v, v
    if isinstance(n, KIndex):
        return None if n.rows else expr_range(index(n.expr), ranges)
    if isinstance(n, KConvert):
        r = rng(n.arg)
        if r is None:
            return None
        if n.dtype == torch.bool:
            return (1, 1) if r[0] > 0 or r[1] < 0 else (0, 0) if r == (0, 0) else (0, 1)
        limits = torch.iinfo(n.dtype)
        return r if limits.min <= r[0] and r[1] <= limits.max else None  # a narrowing that may wrap: unknown
    if not isinstance(n, KOp):
        return None
    rs = [rng(a) for a in n.operands]
    fn = n.fn
    if fn == "where":
        c, a, b = rs
        if c is not None and c[0] == c[1]:
            return a if c[0] else b
        return None if a is None or b is None else (min(a[0], b[0]), max(a[1], b[1]))
    if any(r is None for r in rs):
        return None
    if fn == "add":
        return rs[0][0] + rs[1][0], rs[0][1] + rs[1][1]
    if fn == "sub":
        return rs[0][0] - rs[1][1], rs[0][1] - rs[1][0]
    if fn == "neg":
        return -rs[0][1], -rs[0][0]
    if fn == "mul":
        products = [x * y for x in rs[0] for y in rs[1]]
        return min(products), max(products)
    if fn in ("maximum", "minimum"):
        pick = max if fn == "maximum" else min
        return pick(rs[0][0], rs[1][0]), pick(rs[0][1], rs[1][1])
    if fn in _COMPARISONS or fn in ("eq", "ne"):
        (alo, ahi), (blo, bhi) = rs
        always, never = {
            "ge": (alo >= bhi, ahi < blo),
            "gt": (alo > bhi, ahi <= blo),
            "le": (ahi <= blo, alo > bhi),
            "lt": (ahi < blo, alo >= bhi),
            "eq": (alo == ahi == blo == bhi, ahi < blo or alo > bhi),
            "ne": (ahi < blo or alo > bhi, alo == ahi == blo == bhi),
        }[fn]
        return (1, 1) if always else (0, 0) if never else (0, 1)
    truth = [(r[0] > 0 or r[1] < 0, r == (0, 0)) for r in rs]  # (always true, always false)
    if fn == "logical_not":
        ((t, f),) = truth
        return (0, 0) if t else (1, 1) if f else (0, 1)
    if fn in ("logical_and", "bitwise_and") and n.dtype == torch.bool:
        if all(t for t, _ in truth):
            return 1, 1
        return (0, 0) if any(f for _, f in truth) else (0, 1)
    if fn in ("logical_or", "bitwise_or") and n.dtype == torch.bool:
        if any(t for t, _ in truth):
            return 1, 1
        return (0, 0) if all(f for _, f in truth) else (0, 1)
    return None


def expr_range(expr, ranges: dict) -> tuple[int, int] | None:
    """[lo, hi] of an integer index expression (sums, products by constants, Min, Max) over `ranges`."""
    if expr.is_Integer:
        return int(expr), int(expr)
    if isinstance(expr, sympy.Symbol):
        return ranges.get(expr)
    parts = [expr_range(a, ranges) for a in expr.args]
    if any(p is None for p in parts) or not parts:
        return None
    if isinstance(expr, sympy.Add):
        return sum(p[0] for p in parts), sum(p[1] for p in parts)
    if isinstance(expr, sympy.Mul):
        lo, hi = parts[0]
        for plo, phi in parts[1:]:
            products = [lo * plo, lo * phi, hi * plo, hi * phi]
            lo, hi = min(products), max(products)
        return lo, hi
    if isinstance(expr, (sympy.Min, sympy.Max)):
        pick = min if isinstance(expr, sympy.Min) else max
        return pick(p[0] for p in parts), pick(p[1] for p in parts)
    return None


def simplify_clamps(expr, ranges: dict):
    """`expr` with each Min or Max that `ranges` decides replaced by the operand it takes."""
    if not expr.has(sympy.Min, sympy.Max):
        return expr
    args = [simplify_clamps(a, ranges) for a in expr.args]
    if isinstance(expr, (sympy.Min, sympy.Max)):
        spans = [expr_range(a, ranges) for a in args]
        for i, (a, span) in enumerate(zip(args, spans)):
            others = [s for j, s in enumerate(spans) if j != i]
            if span is None or any(s is None for s in others):
                continue
            if isinstance(expr, sympy.Min) and all(span[1] <= s[0] for s in others):
                return a
            if isinstance(expr, sympy.Max) and all(span[0] >= s[1] for s in others):
                return a
        return expr.func(*args)
    return expr.func(*args)
