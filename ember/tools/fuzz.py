"""`ember fuzz` / `python -m ember.tools.fuzz`: random programs, each checked against eager PyTorch.

    python -m ember.tools.fuzz --seed 0 --count 200            # 200 programs, repros to results/fuzz-repros/
    python -m ember.tools.fuzz --seed 0 --only 17 --show       # print program 17 of seed 0

A program is a straight-line function of a few input tensors: chains of pointwise ops (unary,
binary with broadcasting and Python scalars, where, casts), reductions (sum, mean, amax, amin,
var; keepdim or not), views (reshape, permute, transpose, expand, unsqueeze, squeeze, slices
with steps, select), matmuls and concatenations. Shapes are random with size-1, zero-size and
odd dims; inputs may be transposed or strided; dtypes mix float32, bfloat16, float16, int64 and
bool. The generator keeps the program valid by construction: every value carries its shape and
dtype (read off a meta-tensor evaluation of the op it chose), and an op is only picked with
operands it accepts. Program `i` of seed `s` depends on (s, i) alone.

Checking. Each program runs eagerly and compiled with ember (the C++ backend by default). A
*reference* is the same program in float64 (floating inputs upcast, every float dtype in a cast
retargeted to float64), as PyTorch's dynamo benchmarks compare against a float64 run. For each
output:

* dtype and shape must equal eager's;
* integer and bool outputs must equal eager's exactly;
* a float element c (compiled) passes, with e (eager) and r (reference), when its class
  (NaN, +inf, -inf, finite) is eager's or the reference's, and if finite,
      |c - r| <= 2 |e - r| + tol * (|r| + scale)      (or, where r is not finite, |c - e| <= tol * (|e| + scale))
  with scale = max(1, mean |r|) over the output and tol = 1e-4 for float32-only programs (1e-3 for
  gradients, which sum over broadcasts with cancellation: the training tolerance of PyTorch's dynamo
  benchmarks), 2^-6 with float16 anywhere and 2^-5 with bfloat16 anywhere. The reference's class
  is taken after rounding it to the output's dtype (a value past float32's range is inf there). The 2 |e - r| term is eager's own
  error: ember may be more accurate than eager (it keeps bf16 intermediates in float32, and its
  formulas differ: gelu's erf form loses digits in eager's tail that ember keeps), never much less.

A few programs (8%) have rows of 4097 to 33001 elements, past the split-reduction and persistent-
reduction thresholds. sin, cos and exp are kept off values summed from 256 or more terms: their
absolute error (fine relative to the sum) would be as large as the result.

Bool and integer results compare exactly, so the generator keeps ops with a discontinuity away
from values that rounding can move across it: floor/ceil and float->int casts read only values
no float arithmetic made (inputs, views, casts, concatenations); comparisons read no value made
by low-precision arithmetic, and compare computed values with 0 only (layer_norm over two
elements is exactly +-1 in one implementation and 1 - ulp in another).

30% of the programs also check gradients: one backward with fixed pseudo-random cotangents,
and each float input's gradient compared by the same rule.

Several programs are compiled as one function (`--batch`), to pay the C++ compiler once per
batch; a batch with a mismatch, a crash or an eager fallback is re-run program by program so the
culprit is named. A failing program is written as a standalone script (plain torch and
`backend="ember"`) to `--repro-dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import os
import random
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
LOW = (torch.bfloat16, torch.float16)
DTYPE_NAMES = {
    torch.float32: "torch.float32",
    torch.bfloat16: "torch.bfloat16",
    torch.float16: "torch.float16",
    torch.int64: "torch.int64",
    torch.bool: "torch.bool",
}
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


@dataclass
class Val:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fragile: bool = False  # low-precision arithmetic made it: rounding may move it across a boundary
    computed: bool = False  # float arithmetic made it (in any precision): it may sit on a boundary by 1 ulp
    # A sum of many terms (or derived from one): large, with an absolute error that sin, cos and exp
    # would turn into an error as large as their result (sin(12289 + 1e-3)).
    big: bool = False

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Program:
    """One generated program: its inputs (construction code) and its body (statements)."""

    seed: int
    index: int
    inputs: list[tuple[Val, str]] = field(default_factory=list)  # (value, constructor expression)
    body: list[str] = field(default_factory=list)
    outputs: list[Val] = field(default_factory=list)
    dynamic: bool = False
    grad: bool = False  # also check the gradients of every float input (one backward with fixed cotangents)

    @property
    def low_precision(self) -> set[torch.dtype]:
        text = "\n".join(self.body + [c for _, c in self.inputs])
        return {d for d in LOW if DTYPE_NAMES[d] in text}

    def source(self, name: str = "program", reference: bool = False) -> str:
        """The program as a Python function; `reference` turns every float dtype into float64."""
        args = ", ".join(v.name for v, _ in self.inputs)
        lines = [f"def {name}({args}):"]
        for stmt in self.body:
            lines.append("    " + (_to_fp64(stmt) if reference else stmt))
        outs = ", ".join(v.name for v in self.outputs)
        lines.append(f"    return ({outs},)")
        return "\n".join(lines) + "\n"

    def inputs_source(self, name: str = "make_inputs") -> str:
        """`name(device="cpu")`: the inputs, drawn on the CPU (the same values everywhere), then moved."""
        seed = _input_seed(self.seed, self.index)
        lines = [f'def {name}(device="cpu"):', f"    g = torch.Generator().manual_seed({seed})"]
        for v, ctor in self.inputs:
            lines.append(f"    {v.name} = {ctor}")
        lines.append(f"    return [{', '.join(v.name for v, _ in self.inputs)}]")
        return "\n".join(lines) + "\n"


def _to_fp64(text: str) -> str:
    for name in ("torch.bfloat16", "torch.float16", "torch.float32"):
        text = text.replace(name, "torch.float64")
    return text


def _mentions(expr: str, name: str) -> bool:
    return re.search(rf"\b{name}\b", expr) is not None


def _input_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % (2**31)


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
            self.emit(tmpl.format(v.name, v.name), fragile=v.dtype in LOW or v.fragile)
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
        self.emit(tmpl.format(a.name, b.name), fragile=fragile)
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


# ---------------------------------------------------------------------------------------------
# Checking


@dataclass
class Outcome:
    program: Program
    status: str  # "ok" | "fallback" | "mismatch" | "crash" | "invalid"
    detail: str = ""


GRAD_TOL = 1e-3


def _tol(low: set[torch.dtype]) -> float:
    if torch.bfloat16 in low:
        return 2**-5
    if torch.float16 in low:
        return 2**-6
    return 1e-4


def compare(compiled: torch.Tensor, eager: torch.Tensor, ref: torch.Tensor, tol: float) -> str | None:
    """None if `compiled` passes against eager and the float64 reference (see the module docstring)."""
    if not isinstance(compiled, torch.Tensor):
        return f"compiled returned {type(compiled).__name__}"
    if compiled.shape != eager.shape:
        return f"shape {tuple(compiled.shape)} != eager {tuple(eager.shape)}"
    if compiled.dtype != eager.dtype:
        return f"dtype {compiled.dtype} != eager {eager.dtype}"
    if compiled.numel() == 0:
        return None
    if not eager.is_floating_point():
        if torch.equal(compiled, eager):
            return None
        bad = (compiled != eager).nonzero()[0].tolist()
        return f"{int((compiled != eager).sum())} elements differ, first at {bad}: {compiled[tuple(bad)]} vs {eager[tuple(bad)]}"
    c, e, r = (t.detach().double() for t in (compiled, eager, ref.to(eager.device)))

    def cls(t):
        return torch.where(torch.isnan(t), 0, torch.where(t == math.inf, 1, torch.where(t == -math.inf, 2, 3)))

    # The reference's class as the output's dtype holds it: a value past float32's range is inf there.
    cc, ce, cr = cls(c), cls(e), cls(ref.to(eager.device, eager.dtype).double())
    bad = (cc != ce) & (cc != cr)
    finite_r = torch.isfinite(r)
    scale = max(1.0, r[finite_r].abs().mean().item()) if finite_r.any() else 1.0
    fin = (cc == 3) & ~bad
    err = torch.where(finite_r, (c - r).abs(), (c - e).abs())
    bound = torch.where(finite_r, 2 * (e - r).abs() + tol * (r.abs() + scale), tol * (e.abs() + scale))
    bound = torch.where(torch.isfinite(bound), bound, torch.full_like(bound, math.inf))
    bad = bad | (fin & ~(err <= bound))
    if not bad.any():
        return None
    where = bad.nonzero()[0].tolist()
    at = tuple(where)
    return (
        f"{int(bad.sum())}/{bad.numel()} elements off, first at {where}: compiled {c[at].item():.6g}, "
        f"eager {e[at].item():.6g}, fp64 reference {r[at].item():.6g} (tol {tol:g}, scale {scale:.3g})"
    )


def _exec(source: str) -> dict:
    ns: dict = {"torch": torch}
    exec(compile(source, "<ember-fuzz>", "exec"), ns)  # noqa: S102 - our own generated program
    return ns


def _as_list(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def _upcast(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [x.double() if x.is_floating_point() else x for x in inputs]


def cotangents(outputs: list) -> list:
    """Fixed pseudo-random cotangents for the outputs that require grad (the same for eager, ember, fp64)."""
    gen = torch.Generator().manual_seed(12345)
    diff = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    return [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in diff]


def grads(outputs: list, inputs: list, cots: list | None = None) -> list:
    """Gradients of the outputs that require grad, with `cots` (default: `cotangents(outputs)`), w.r.t.
    each input that requires grad; an input the outputs do not depend on gets zeros."""
    leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
    diff = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    if not leaves or not diff:
        return [torch.zeros_like(x) for x in leaves]
    cots = cotangents(outputs) if cots is None else cots
    found = torch.autograd.grad(diff, leaves, cots, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g.detach() for g, x in zip(found, leaves)]


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _requiring_grad(inputs: list) -> list:
    return [x.requires_grad_(True) if x.is_floating_point() else x for x in inputs]


# Graphs, kernels and externs compiled (including batches re-run to isolate a failure).
STATS = {"graphs": 0, "kernels": 0, "externs": 0}


def check_batch(programs: list[Program], options: dict, device: str = "cpu") -> tuple[list[Outcome] | None, str]:
    """Compile the programs as one function: (per-program outcomes, "") or, if the batch needs
    splitting, (None, what went wrong)."""
    from ember.report import collecting

    ns_src = []
    for k, p in enumerate(programs):
        ns_src += [p.source(f"program_{k}"), p.source(f"reference_{k}", reference=True), p.inputs_source(f"inputs_{k}")]
    ns = _exec("\n".join(ns_src))
    grad = any(p.grad for p in programs)  # run() batches gradient programs apart
    all_inputs = [ns[f"inputs_{k}"](device) for k in range(len(programs))]
    if grad:
        all_inputs = [_requiring_grad(xs) for xs in all_inputs]
    eager_outs, ref_outs, outcomes = [], [], [None] * len(programs)
    for k, p in enumerate(programs):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)  # e.g. var() with too few degrees of freedom
                # autograd.grad accumulates nothing: eager and ember may share the input leaves.
                eager_inputs = all_inputs[k]
                ref_inputs = [x.detach().requires_grad_(x.requires_grad) for x in _upcast(all_inputs[k])]
                eager = _as_list(ns[f"program_{k}"](*eager_inputs))
                with _default_dtype(torch.float64):  # int / 0.5 is float64 in the reference
                    ref = _as_list(ns[f"reference_{k}"](*ref_inputs))
                if grad:
                    eager = [o.detach() for o in eager] + grads(eager, eager_inputs)
                    ref = [o.detach() for o in ref] + grads(ref, ref_inputs)
                eager_outs.append(eager)
                ref_outs.append(ref)
        except Exception as e:  # noqa: BLE001 - counted, never silently dropped
            outcomes[k] = Outcome(p, "invalid", f"eager or the reference raised {type(e).__name__}: {e}")
            eager_outs.append(None)
            ref_outs.append(None)
    live = [k for k in range(len(programs)) if outcomes[k] is None]
    counts = [len(programs[k].inputs) for k in live]

    def batch(*args):
        outs, at = [], 0
        for k, n in zip(live, counts):
            outs.append(ns[f"program_{k}"](*args[at : at + n]))
            at += n
        return tuple(outs)

    flat = [x for k in live for x in all_inputs[k]]
    dynamic = any(programs[k].dynamic for k in live)  # run() batches static and dynamic programs apart
    torch._dynamo.reset()
    crash = None
    with warnings.catch_warnings(record=True) as caught, collecting() as report:
        warnings.simplefilter("always")
        try:
            compiled = torch.compile(batch, backend="ember", dynamic=dynamic or None, options=options)
            got = compiled(*flat) if live else ()
            if grad and live:
                # One backward for the whole batch: the programs share no inputs, so each one's
                # gradients are its own.
                every = [o for j in range(len(live)) for o in _as_list(got[j])]
                cots = [c for j in range(len(live)) for c in cotangents(_as_list(got[j]))]
                flat_grads = iter(grads(every, flat, cots))
                got = [
                    [o.detach() for o in _as_list(got[j])]
                    + [next(flat_grads) for x in all_inputs[k] if x.requires_grad]
                    for j, k in enumerate(live)
                ]
        except Exception as e:  # noqa: BLE001
            crash = f"{type(e).__name__}: {e}"[:2000] + "\n" + traceback.format_exc()[-3000:]
    fallbacks = [g.fallback for g in report.graphs if g.fallback]
    STATS["graphs"] += len(report.graphs)
    STATS["kernels"] += sum(len(g.kernels) for g in report.graphs)
    STATS["externs"] += sum(len(g.externs) for g in report.graphs)
    if crash or fallbacks:
        trouble = f"crash: {crash}" if crash else "fallback: " + "; ".join(fallbacks)
        if len(programs) > 1:
            return None, trouble
        if crash:
            return [Outcome(programs[0], "crash", crash)], ""
        return [Outcome(programs[0], "fallback", "; ".join(fallbacks))], ""
    del caught
    tol_of = {k: _tol(programs[k].low_precision) for k in live}
    for j, k in enumerate(live):
        outs = _as_list(got[j])
        problems = []
        if len(outs) != len(eager_outs[k]):
            problems.append(f"{len(outs)} outputs, eager has {len(eager_outs[k])}")
        names = [f"output {i} ({v.name})" for i, v in enumerate(programs[k].outputs)]
        if grad:
            names += [f"grad of {v.name}" for (v, _), x in zip(programs[k].inputs, all_inputs[k]) if x.requires_grad]
        n_out = len(programs[k].outputs)
        for i, (c, e, r) in enumerate(zip(outs, eager_outs[k], ref_outs[k])):
            # Gradients sum over broadcasts, often with cancellation: float32 gets 1e-3, as PyTorch's
            # dynamo benchmarks give training.
            msg = compare(c, e, r, tol_of[k] if i < n_out else max(tol_of[k], GRAD_TOL))
            if msg:
                problems.append(f"{names[i]}: {msg}")
        if problems and len(programs) > 1:
            return None, f"mismatch: program {programs[k].index}: " + "; ".join(problems)  # re-run it alone
        outcomes[k] = Outcome(programs[k], "mismatch" if problems else "ok", "; ".join(problems))
    return outcomes, ""


def check(programs: list[Program], options: dict, device: str = "cpu") -> list[Outcome]:
    """Check a batch; split it where something went wrong, down to single programs.

    If every part passes on its own, the batch's trouble is blamed on all its programs (ember got
    them wrong only together), never dropped."""
    out, trouble = check_batch(programs, options, device)
    if out is not None:
        return out
    mid = len(programs) // 2
    parts = check(programs[:mid], options, device) + check(programs[mid:], options, device)
    if any(o.status not in ("ok", "invalid") for o in parts):
        return parts
    status = trouble.split(":", 1)[0]
    together = f"only when compiled together with programs {[p.index for p in programs]}: {trouble}"
    return [Outcome(o.program, status, together) if o.status == "ok" else o for o in parts]


# ---------------------------------------------------------------------------------------------
# Repro scripts


REPRO = '''"""ember fuzz repro: seed {seed}, program {index} ({status}).

{detail}

Rerun: python {filename}
Regenerate: python -m ember.tools.fuzz --seed {seed} --only {index}
"""

import math

import torch

{compare}

{grads}
{program}
{reference}
{inputs}

GRAD = {grad!r}  # also compare the gradients of the float inputs


def main():
    inputs = make_inputs({device!r})
    if GRAD:
        inputs = [x.requires_grad_(True) if x.is_floating_point() else x for x in inputs]
    ref_inputs = [x.detach().double().requires_grad_(x.requires_grad) if x.is_floating_point() else x for x in inputs]
    expected = list(program(*inputs))
    torch.set_default_dtype(torch.float64)  # int / 0.5 is float64 in the reference
    reference = list(reference_program(*ref_inputs))
    torch.set_default_dtype(torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(program, backend="ember", dynamic={dynamic}, options={options!r})
    got = list(compiled(*inputs))
    if GRAD:
        expected = [o.detach() for o in expected] + grads(expected, inputs)
        reference = [o.detach() for o in reference] + grads(reference, ref_inputs)
        got = [o.detach() for o in got] + grads(got, inputs)
    failed = len(got) != len(expected)
    n_out = len(got) - (sum(x.requires_grad for x in inputs) if GRAD else 0)
    for i, (c, e, r) in enumerate(zip(got, expected, reference)):
        problem = compare(c, e, r, {tol!r} if i < n_out else max({tol!r}, {grad_tol!r}))
        failed = failed or problem is not None
        print(f"output {{i}}: {{problem or 'ok'}}")
    print("MISMATCH" if failed else "all outputs match")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
'''


def write_repro(outcome: Outcome, directory: Path, options: dict, device: str = "cpu") -> Path:
    p = outcome.program
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"repro_seed{p.seed}_{p.index}.py"
    text = REPRO.format(
        seed=p.seed,
        index=p.index,
        status=outcome.status,
        detail=outcome.detail.replace('"""', "'''")[:3000],
        filename=path.name,
        program=p.source("program"),
        reference=p.source("reference_program", reference=True),
        inputs=p.inputs_source("make_inputs"),
        dynamic=p.dynamic or None,
        options=options,
        compare=inspect.getsource(compare),
        grads=inspect.getsource(cotangents) + "\n\n" + inspect.getsource(grads),
        grad=p.grad,
        tol=_tol(p.low_precision),
        grad_tol=GRAD_TOL,
        device=device,
    )
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------
# Driver


@dataclass
class Summary:
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[Outcome] = field(default_factory=list)
    fallbacks: list[Outcome] = field(default_factory=list)
    invalid: list[Outcome] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def mismatches(self) -> int:
        return self.counts.get("mismatch", 0) + self.counts.get("crash", 0)


def run(
    seed: int,
    count: int,
    start: int = 0,
    batch: int = 8,
    options: dict | None = None,
    repro_dir: str | Path | None = None,
    log=None,
    device: str = "cpu",
) -> Summary:
    """Generate and check programs start..start+count-1 of `seed`."""
    options = {"backend": "cpp", **(options or {})}
    summary = Summary()
    t0 = time.time()
    indices = list(range(start, start + count))
    for b in range(0, len(indices), batch):
        progs = [generate(seed, i) for i in indices[b : b + batch]]
        # Static and dynamic-shape programs compile apart: a program is checked the way it is replayed.
        kinds = sorted({(p.dynamic, p.grad) for p in progs})
        groups = [[p for p in progs if (p.dynamic, p.grad) == kind] for kind in kinds]
        outcomes = [o for g in groups if g for o in check(g, options, device)]
        for o in sorted(outcomes, key=lambda o: o.program.index):
            summary.counts[o.status] = summary.counts.get(o.status, 0) + 1
            if o.status in ("mismatch", "crash"):
                summary.failures.append(o)
            elif o.status == "fallback":
                summary.fallbacks.append(o)
            elif o.status == "invalid":
                summary.invalid.append(o)
            if o.status != "ok":
                where = (
                    write_repro(o, Path(repro_dir), options, device) if repro_dir and o.status != "invalid" else None
                )
                if log:
                    log(
                        f"program {o.program.index}: {o.status}: {o.detail[:400]}"
                        + (f"\n  repro: {where}" if where else "")
                    )
        if log:
            done = min(b + batch, len(indices))
            log(f"[{done}/{len(indices)}] {time.time() - t0:.0f}s {dict(sorted(summary.counts.items()))}")
    summary.seconds = time.time() - t0
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="ember fuzz", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--start", type=int, default=0, help="index of the first program")
    p.add_argument("--only", type=int, default=None, help="just program ONLY of the seed")
    p.add_argument("--batch", type=int, default=8, help="programs compiled together (one C++ build per batch)")
    p.add_argument("--backend", default="cpp", choices=["cpp", "triton"])
    p.add_argument("--device", default="cpu", help="where the inputs live: cpu, cuda (use --backend triton)")
    p.add_argument("--repro-dir", default="results/fuzz-repros")
    p.add_argument("--show", action="store_true", help="print the programs instead of running them")
    args = p.parse_args(argv)
    start, count = (args.only, 1) if args.only is not None else (args.start, args.count)
    if args.show:
        for i in range(start, start + count):
            prog = generate(args.seed, i)
            flags = [f for f, on in (("dynamic", prog.dynamic), ("gradients", prog.grad)) if on]
            print(f"# seed {args.seed} program {i}{' (' + ', '.join(flags) + ')' if flags else ''}")
            print(prog.inputs_source() + "\n" + prog.source())
        return 0
    if args.backend == "triton" and args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # Triton's CPU interpreter (before triton is imported)
    print(
        f"ember fuzz: seed {args.seed}, programs {start}..{start + count - 1}, backend {args.backend}, "
        f"device {args.device}",
        flush=True,
    )
    s = run(
        args.seed,
        count,
        start,
        args.batch,
        {"backend": args.backend},
        args.repro_dir,
        log=lambda m: print(m, flush=True),
        device=args.device,
    )
    print(
        f"done: {count} programs in {s.seconds:.0f}s: {s.counts.get('ok', 0)} ok, "
        f"{s.counts.get('fallback', 0)} fell back to eager, {s.counts.get('mismatch', 0)} mismatches, "
        f"{s.counts.get('crash', 0)} crashes, {s.counts.get('invalid', 0)} invalid (eager raised)"
    )
    print(f"compiled {STATS['graphs']} graphs: {STATS['kernels']} ember kernels, {STATS['externs']} ATen externs")
    causes: dict[str, list[int]] = {}
    for o in s.fallbacks:
        cause = re.sub(r"\d+", "N", o.detail.splitlines()[0] if o.detail else "")[:160]
        causes.setdefault(cause, []).append(o.program.index)
    for cause, which in sorted(causes.items(), key=lambda kv: -len(kv[1])):
        print(
            f"  fell back {len(which)}x: {cause}  (programs {', '.join(map(str, which[:8]))}{' ...' if len(which) > 8 else ''})"
        )
    for o in s.failures:
        print(f"  FAIL: program {o.program.index} ({o.status}): {o.detail[:300]}")
    return 1 if s.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
