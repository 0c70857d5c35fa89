"""The random-program generator: straight-line programs valid by construction.

Every value carries its shape and dtype (read off a meta-tensor evaluation of the op chosen), and an
op is only picked with operands it accepts. Program `i` of seed `s` depends on (s, i) alone.
"""

from __future__ import annotations

import math
import random
import re

import torch

from ember.tools.fuzz.program import DTYPE_NAMES, FLOATS, LOW, Program, Val

SIZES = (1, 1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 31, 33)
MAX_NUMEL = 4096
LARGE_NUMEL = 40000

UNARY_FLOAT = (
    "torch.exp({})",
    "torch.log({})",
    "torch.tanh({})",
    "torch.sigmoid({})",
    "torch.sqrt({})",
    "torch.rsqrt({})",
    "torch.sin({})",
    "torch.cos({})",
    "torch.erf({})",
    "torch.log1p({})",
    "torch.expm1({})",
    "torch.reciprocal({})",
    "torch.relu({})",
    "torch.nn.functional.gelu({})",
    "torch.nn.functional.silu({})",
    "torch.abs({})",
    "(-{})",
    "({} * {})",
    "torch.clamp({}, -2.0, 3.0)",
    "torch.exp2({})",
    "torch.log2({})",
)
# Functions whose absolute error is about their argument's absolute error (kept off `big` values).
AMPLIFYING = ("torch.exp({})", "torch.sin({})", "torch.cos({})", "torch.expm1({})", "torch.exp2({})")
# Functions whose result is unbounded for ordinary arguments (a big value): sin(expm1(x3 / x4))
# with x4 near 0 differs between any two correct implementations (GPU fuzz program 1406).
UNBOUNDED = ("torch.exp({})", "torch.expm1({})", "torch.exp2({})", "torch.reciprocal({})", "torch.rsqrt({})")
UNARY_INT = ("(-{})", "torch.abs({})", "({} * 3)", "torch.clamp({}, -3, 4)", "({} + 1)")
UNARY_DISCONTINUOUS = ("torch.floor({})", "torch.ceil({})")
BINARY_ARITH = (
    "torch.add({}, {})",
    "torch.sub({}, {})",
    "torch.mul({}, {})",
    "torch.maximum({}, {})",
    "torch.minimum({}, {})",
)
BINARY_FLOAT = ("torch.div({}, {})", "torch.pow(torch.abs({}), {})", "torch.add({}, {}, alpha=0.5)")
COMPARE = (
    "torch.eq({}, {})",
    "torch.ne({}, {})",
    "torch.lt({}, {})",
    "torch.le({}, {})",
    "torch.gt({}, {})",
    "torch.ge({}, {})",
)
LOGICAL = (
    "torch.logical_and({}, {})",
    "torch.logical_or({}, {})",
    "torch.bitwise_and({}, {})",
    "torch.bitwise_or({}, {})",
)
# Tensor-scalar forms: {0} is the tensor, {1} the Python scalar.
SCALAR_BINARY = (
    "({0} + {1})",
    "({0} - {1})",
    "({1} - {0})",
    "({0} * {1})",
    "torch.clamp_min({0}, {1})",
    "torch.clamp_max({0}, {1})",
)
SCALAR_BINARY_FLOAT = ("({0} / {1})", "({1} / {0})", "torch.pow(torch.abs({0}), {1})")
SCALAR_BINARY_INT = ("({0} / {1})", "torch.div({0}, {1}, rounding_mode='floor')", "torch.remainder({0}, {1})")
SCALAR_FLOAT = (0.5, -1.25, 2.0, 3.0, 1e-3)
SCALAR_INT = (1, 2, -3, 7)


def _mentions(expr: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", expr) is not None


class Generator:
    """Builds one program; every op is chosen so that it is valid for its operands."""

    def __init__(self, seed: int, index: int):
        self.rng = random.Random(f"ember-fuzz-{seed}-{index}")
        self.prog = Program(seed, index)
        self.values: list[Val] = []
        self.meta: dict[str, torch.Tensor] = {}
        self.count = 0
        self.dtypes = self._pick_dtypes()
        # A few programs have long rows (past ember's split-reduction and persistent-reduction
        # thresholds); the rest stay small, so that thousands of them run in minutes.
        self.large = self.rng.random() < 0.08
        self.max_numel = LARGE_NUMEL if self.large else MAX_NUMEL

    # -- program-level choices -----------------------------------------------------------------
    def _pick_dtypes(self) -> list[torch.dtype]:
        r = self.rng.random()
        if r < 0.45:
            return [torch.float32]
        if r < 0.6:
            return [torch.bfloat16, torch.float32]
        if r < 0.7:
            return [torch.float16, torch.float32]
        if r < 0.8:
            return [torch.int64, torch.float32]
        if r < 0.88:
            return [torch.bool, torch.float32, torch.int64]
        return [torch.float32, torch.bfloat16, torch.int64, torch.bool]

    def build(self) -> Program:
        rng = self.rng
        if self.large:
            self.new_input(self.large_shape(), rng.choice(self.dtypes))
        for _ in range(rng.choice((1, 1, 2, 3)) - self.large):
            self.new_input(self.random_shape(), rng.choice(self.dtypes))
        steps = rng.randint(2, 9)
        for _ in range(steps):
            self.step()
        self.prog.outputs = self.pick_outputs()
        self.prog.dynamic = rng.random() < 0.15
        self.prog.grad = rng.random() < 0.3
        return self.prog

    def pick_outputs(self) -> list[Val]:
        produced = [v for v in self.values if not v.name.startswith("x")]
        if not produced:
            produced = self.values
        outs = [produced[-1]]
        for v in produced[:-1]:
            if self.rng.random() < 0.2 and len(outs) < 3:
                outs.append(v)
        return outs

    def random_shape(self, rank: int | None = None) -> tuple[int, ...]:
        rng = self.rng
        rank = rng.choice((0, 1, 1, 2, 2, 2, 3, 3, 4)) if rank is None else rank
        while True:
            shape = [rng.choice(SIZES) for _ in range(rank)]
            if rank and rng.random() < 0.06:
                shape[rng.randrange(rank)] = 0
            if math.prod(shape) <= MAX_NUMEL:
                return tuple(shape)

    def large_shape(self) -> tuple[int, ...]:
        n = self.rng.choice((4097, 5000, 8192, 12289, 16385, 33001))
        return self.rng.choice(((n,), (1, n), (LARGE_NUMEL // n, n), (n, 1)))

    # -- values ------------------------------------------------------------------------------
    def fresh(self, prefix: str = "v") -> str:
        self.count += 1
        return f"{prefix}{self.count}"

    def new_input(self, shape: tuple[int, ...], dtype: torch.dtype) -> Val:
        rng = self.rng
        name = self.fresh("x")
        layout = rng.random()
        if len(shape) >= 2 and layout < 0.2:
            # Transposed: allocate with the last two dims swapped, then swap them back.
            stored = shape[:-2] + (shape[-1], shape[-2])
            ctor = f"{_random_tensor(stored, dtype)}.transpose(-1, -2)"
        elif len(shape) >= 1 and layout < 0.35:
            # Strided: every other element of the last dim.
            stored = shape[:-1] + (2 * shape[-1],)
            ctor = f"{_random_tensor(stored, dtype)}[..., ::2]"
        elif len(shape) >= 3 and layout < 0.45:
            perm = list(range(len(shape)))
            rng.shuffle(perm)
            inv = [perm.index(k) for k in range(len(shape))]
            stored = tuple(shape[p] for p in perm)
            ctor = f"{_random_tensor(stored, dtype)}.permute({tuple(inv)})"
        else:
            ctor = _random_tensor(shape, dtype)
        v = Val(name, shape, dtype)
        self.meta[name] = torch.empty(shape, dtype=dtype, device="meta")
        self.prog.inputs.append((v, ctor))
        self.values.append(v)
        return v

    def emit(self, expr: str, fragile: bool, movement: bool = False, big: bool | None = None) -> Val:
        """Add `name = expr`; its shape and dtype come from evaluating expr on meta tensors.

        `movement`: the op only moves or converts values (view, cast, cat), it computes nothing."""
        name = self.fresh()
        try:
            out = eval(expr, {"torch": torch}, dict(self.meta))
        except Exception as e:
            raise AssertionError(f"fuzz generator made an invalid op: {name} = {expr}\n{e}") from e
        self.meta[name] = out
        operands = [v for v in self.values if _mentions(expr, v.name)]
        computed = any(v.computed for v in operands) or (not movement and out.dtype in FLOATS)
        big = any(v.big for v in operands) if big is None else big
        v = Val(name, tuple(out.shape), out.dtype, fragile, computed, big)
        self.prog.body.append(f"{name} = {expr}")
        self.values.append(v)
        return v

    def pick(self, pred=lambda v: True) -> Val | None:
        """A value, preferring recent ones (so programs are chains)."""
        cands = [v for v in self.values if pred(v)]
        if not cands:
            return None
        k = min(len(cands) - 1, int(self.rng.expovariate(1.0)))
        return cands[-1 - k]

    def operand_like(self, v: Val, dtype: torch.dtype | None = None) -> Val:
        """A value broadcastable against v: an existing one, or a new input with some dims 1."""
        rng = self.rng
        dtype = dtype or v.dtype
        existing = [
            w
            for w in self.values
            if w is not v and w.dtype == dtype and _broadcast(w.shape, v.shape) == v.shape and rng.random() < 0.5
        ]
        if existing:
            return existing[-1]
        shape = list(v.shape)
        for k in range(len(shape)):
            if rng.random() < 0.3:
                shape[k] = 1
        drop = rng.randint(0, len(shape)) if rng.random() < 0.3 else 0
        return self.new_input(tuple(shape[drop:]), dtype)

    # -- one op --------------------------------------------------------------------------------
    def step(self) -> None:
        rng = self.rng
        kinds = ["unary"] * 4 + ["binary"] * 4 + ["view"] * 4 + ["reduce"] * 3 + ["where", "cast", "cast", "compare"]
        kinds += ["matmul", "cat", "composite"]
        for _ in range(20):
            kind = rng.choice(kinds)
            if getattr(self, "op_" + kind)():
                return

    def op_unary(self) -> bool:
        v = self.pick(lambda v: v.dtype != torch.bool)
        if v is None:
            return False
        if v.dtype in FLOATS:
            if not v.computed and self.rng.random() < 0.1:
                tmpl = self.rng.choice(UNARY_DISCONTINUOUS)
            else:
                tmpl = self.rng.choice(UNARY_FLOAT)
                if v.big and tmpl in AMPLIFYING:
                    tmpl = "torch.tanh({})"
            big = v.big or tmpl in UNBOUNDED
            self.emit(tmpl.format(v.name, v.name), fragile=v.dtype in LOW or v.fragile, big=big)
        else:
            tmpl = self.rng.choice(UNARY_INT)
            self.emit(tmpl.format(v.name, v.name), fragile=False)
        return True

    def op_binary(self) -> bool:
        rng = self.rng
        v = self.pick()
        if v is None:
            return False
        if v.dtype == torch.bool:
            w = self.operand_like(v)
            self.emit(rng.choice(LOGICAL).format(v.name, w.name), fragile=False)
            return True
        if rng.random() < 0.3:
            floats = v.dtype in FLOATS
            scalar = rng.choice(SCALAR_FLOAT if floats or rng.random() < 0.3 else SCALAR_INT)
            tmpl = rng.choice(SCALAR_BINARY + (SCALAR_BINARY_FLOAT if floats else SCALAR_BINARY_INT))
            if "pow" in tmpl:
                scalar = rng.choice((2, 0.5, 3, 1.5))
            self.emit(tmpl.format(v.name, repr(scalar)), fragile=v.dtype in LOW or v.fragile)
            return True
        # Tensor-tensor: same dtype usually; mixed dtypes promote.
        dtype = v.dtype if rng.random() < 0.7 else rng.choice(self.dtypes)
        if dtype == torch.bool:
            dtype = v.dtype
        w = self.operand_like(v, dtype)
        floats = v.dtype in FLOATS or w.dtype in FLOATS
        tmpl = rng.choice(BINARY_ARITH + (BINARY_FLOAT if floats else ()))
        if "pow" in tmpl and not (v.dtype in FLOATS):
            tmpl = "torch.add({}, {})"
        a, b = (v, w) if rng.random() < 0.6 else (w, v)
        if "alpha" in tmpl and not floats:
            tmpl = "torch.add({}, {})"
        fragile = any(x.fragile or x.dtype in LOW for x in (v, w))
        big = v.big or w.big or tmpl == "torch.div({}, {})"  # by a tensor that may be near 0
        self.emit(tmpl.format(a.name, b.name), fragile=fragile, big=big)
        return True

    def op_compare(self) -> bool:
        v = self.pick(lambda v: not v.fragile and v.dtype != torch.bool)
        if v is None:
            return False
        rng = self.rng
        tmpl = rng.choice(COMPARE)
        if rng.random() < 0.5:
            # A computed value may be exactly 1 in one and 1 - ulp in the other (layer_norm over
            # two elements); exact zeros stay zeros.
            scalar = rng.choice((0, 0.5, -1, 1)) if v.dtype in FLOATS and not v.computed else rng.choice((0, 1, -2))
            if v.computed:
                scalar = 0
            self.emit(tmpl.format(v.name, repr(scalar)), fragile=False)
        else:
            w = self.operand_like(v)
            if w.fragile:
                return False
            self.emit(tmpl.format(v.name, w.name), fragile=False)
        return True

    def op_where(self) -> bool:
        rng = self.rng
        cond = self.pick(lambda v: v.dtype == torch.bool)
        v = self.pick(lambda v: v.dtype != torch.bool)
        if v is None:
            return False
        if cond is None or _broadcast(cond.shape, v.shape) is None:
            base = self.pick(
                lambda w: not w.fragile and w.dtype != torch.bool and _broadcast(w.shape, v.shape) is not None
            )
            if base is None:
                return False
            cond = self.emit(f"({base.name} > 0)", fragile=False)
        other = repr(rng.choice(SCALAR_FLOAT if v.dtype in FLOATS else SCALAR_INT)) if rng.random() < 0.4 else None
        if other is None:
            w = self.operand_like(v)
            other, fragile = w.name, w.fragile or w.dtype in LOW
        else:
            fragile = False
        a, b = (v.name, other) if rng.random() < 0.5 else (other, v.name)
        self.emit(f"torch.where({cond.name}, {a}, {b})", fragile=fragile or v.fragile or v.dtype in LOW)
        return True

    def op_cast(self) -> bool:
        rng = self.rng
        v = self.pick()
        if v is None:
            return False
        target = rng.choice([d for d in (*self.dtypes, torch.float32) if d != v.dtype] or [torch.float32])
        if v.dtype in FLOATS and target in (torch.int64, torch.bool):
            if v.computed:
                return False
            if target == torch.int64:
                # Out-of-range and NaN float -> int conversions are undefined; keep them in range.
                self.emit(f"torch.nan_to_num(torch.clamp({v.name}, -100.0, 100.0)).to({DTYPE_NAMES[target]})", False)
                return True
        # A cast rounds once, in eager and in ember alike: it makes nothing fragile by itself.
        self.emit(f"{v.name}.to({DTYPE_NAMES[target]})", fragile=v.fragile, movement=True)
        return True

    def op_reduce(self) -> bool:
        rng = self.rng
        v = self.pick(lambda v: v.rank >= 1)
        if v is None:
            return False
        nd = rng.randint(1, v.rank)
        dims = sorted(rng.sample(range(v.rank), nd))
        keep = rng.random() < 0.4
        empty = any(v.shape[d] == 0 for d in dims)
        kinds = ["sum"] * 3 + ["amax", "amin"]
        if v.dtype in FLOATS:
            kinds += ["mean", "mean", "var"]
        kind = rng.choice(kinds)
        if kind in ("amax", "amin") and empty:
            kind = "sum"  # eager rejects max over an empty dim
        if v.dtype == torch.bool and kind != "sum":
            kind = "sum"
        dim_arg = dims[0] if len(dims) == 1 and rng.random() < 0.5 else tuple(dims)
        if kind == "var":
            corr = rng.choice((0, 1))
            expr = f"torch.var({v.name}, dim={dim_arg}, correction={corr}, keepdim={keep})"
        elif rng.random() < 0.15 and kind in ("sum", "mean"):
            expr = f"{v.name}.{kind}()"
            dims = list(range(v.rank))
        else:
            expr = f"torch.{kind}({v.name}, dim={dim_arg}, keepdim={keep})"
        many = math.prod(v.shape[d] for d in dims) >= 256
        self.emit(expr, fragile=v.fragile or v.dtype in LOW, big=v.big or (many and kind == "sum"))
        return True

    def op_view(self) -> bool:
        rng = self.rng
        v = self.pick()
        if v is None:
            return False
        kind = rng.choice(("reshape", "permute", "transpose", "expand", "unsqueeze", "squeeze", "slice", "select", "t"))
        r = v.rank
        if kind == "reshape":
            expr = f"{v.name}.reshape({_reshape_target(rng, v.shape)})"
        elif kind == "permute" and r >= 2:
            perm = list(range(r))
            rng.shuffle(perm)
            expr = f"{v.name}.permute({tuple(perm)})"
        elif kind == "transpose" and r >= 2:
            a, b = rng.sample(range(r), 2)
            expr = f"{v.name}.transpose({a}, {-r + b if rng.random() < 0.3 else b})"
        elif kind == "t" and r == 2:
            expr = f"{v.name}.t()"
        elif kind == "expand" and 1 in v.shape:
            shape = [rng.choice((2, 3, 5)) if s == 1 and rng.random() < 0.7 else s for s in v.shape]
            lead = [rng.choice((2, 3))] if rng.random() < 0.3 else []
            if math.prod(shape + lead) > self.max_numel:
                return False
            spec = [-1 if s == o and rng.random() < 0.5 else s for s, o in zip(shape, v.shape)]
            expr = f"{v.name}.expand({tuple(lead + spec)})"
        elif kind == "unsqueeze":
            expr = f"{v.name}.unsqueeze({rng.randint(-r - 1, r)})"
        elif kind == "squeeze" and 1 in v.shape:
            d = rng.choice([k for k, s in enumerate(v.shape) if s == 1])
            expr = f"{v.name}.squeeze({d})"
        elif kind == "slice" and r >= 1:
            d = rng.randrange(r)
            size = v.shape[d]
            start = rng.choice((0, 1, -2, None))
            stop = rng.choice((None, size - 1, -1, size + 3))
            step = rng.choice((1, 1, 2, 3))
            idx = ["..."] if d == r - 1 and rng.random() < 0.5 else [":"] * d
            part = f"{'' if start is None else start}:{'' if stop is None else stop}{'' if step == 1 else f':{step}'}"
            expr = f"{v.name}[{', '.join(idx + [part])}]"
        elif kind == "select" and r >= 1 and all(s > 0 for s in v.shape):
            d = rng.randrange(r)
            i = rng.randrange(-v.shape[d], v.shape[d])
            expr = f"{v.name}.select({d}, {i})"
        else:
            return False
        self.emit(expr, fragile=v.fragile, movement=True)
        return True

    def op_matmul(self) -> bool:
        rng = self.rng
        v = self.pick(lambda v: v.dtype in (torch.float32, torch.bfloat16) and 1 <= v.rank <= 3)
        if v is None:
            return False
        k = v.shape[-1]
        n = rng.choice((1, 3, 8, 17))
        if k * n > self.max_numel:
            return False
        if v.rank == 1 or rng.random() < 0.7:
            w = self.new_input((k, n), v.dtype)
        else:
            w = self.new_input(v.shape[:-2] + (k, n), v.dtype)
        self.emit(f"torch.matmul({v.name}, {w.name})", fragile=v.fragile or v.dtype in LOW, big=v.big or k >= 256)
        return True

    def op_cat(self) -> bool:
        rng = self.rng
        v = self.pick(lambda v: v.rank >= 1)
        if v is None:
            return False
        d = rng.randrange(v.rank)
        if 2 * v.numel > self.max_numel:
            return False
        if rng.random() < 0.5:
            shape = list(v.shape)
            shape[d] = rng.choice((0, 1, 2, 5))
            w = self.new_input(tuple(shape), v.dtype)
            parts = [v.name, w.name]
            fragile = v.fragile
        else:
            w = self.emit(
                f"({v.name} * 2)" if v.dtype != torch.bool else f"(~{v.name})", fragile=v.fragile or v.dtype in LOW
            )
            parts = [w.name, v.name]
            fragile = w.fragile
        self.emit(f"torch.cat([{', '.join(parts)}], dim={d})", fragile=fragile, movement=True)
        return True

    def op_composite(self) -> bool:
        rng = self.rng
        v = self.pick(lambda v: v.dtype in FLOATS and v.rank >= 1)
        if v is None:
            return False
        d = rng.randrange(-v.rank, v.rank)
        choice = rng.choice(("softmax", "log_softmax", "layer_norm"))
        if choice == "layer_norm":
            expr = f"torch.nn.functional.layer_norm({v.name}, ({v.shape[-1]},))"
        else:
            expr = f"torch.{choice}({v.name}, dim={d})"
        self.emit(expr, fragile=v.fragile or v.dtype in LOW)
        return True


def _random_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> str:
    s = repr(tuple(shape))
    if dtype == torch.bool:
        return f"(torch.rand({s}, generator=g) > 0.5).to(device)"
    if dtype == torch.int64:
        return f"torch.randint(-9, 10, {s}, generator=g).to(device)"
    base = f"torch.randn({s}, generator=g)"
    return f"{base}.to(device)" if dtype == torch.float32 else f"{base}.to(device, {DTYPE_NAMES[dtype]})"


def _broadcast(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
    out = []
    for k in range(1, max(len(a), len(b)) + 1):
        x = a[-k] if k <= len(a) else 1
        y = b[-k] if k <= len(b) else 1
        if x != y and 1 not in (x, y):
            return None
        out.append(y if x == 1 else x)
    return tuple(reversed(out))


def _reshape_target(rng: random.Random, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A new shape with the same number of elements: merge neighbours, split a dim, or flatten."""
    n = math.prod(shape)
    choice = rng.random()
    if choice < 0.2 or not shape:
        return (n,) if rng.random() < 0.7 else (1, n)
    dims = list(shape)
    if choice < 0.55 and len(dims) >= 2:
        k = rng.randrange(len(dims) - 1)
        dims[k : k + 2] = [dims[k] * dims[k + 1]]
    else:
        k = rng.randrange(len(dims))
        s = dims[k]
        divisors = [f for f in range(2, s) if s % f == 0]
        if divisors:
            f = rng.choice(divisors)
            dims[k : k + 1] = [f, s // f]
        else:
            dims.insert(k, 1)
    if dims and rng.random() < 0.3 and n > 0:
        dims[rng.randrange(len(dims))] = -1
    return tuple(dims)


def generate(seed: int, index: int) -> Program:
    return Generator(seed, index).build()
