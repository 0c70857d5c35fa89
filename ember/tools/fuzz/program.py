"""What a fuzz program is: values with their shape and dtype, and the program's source text.

A `Program` prints as a plain Python function (and as its float64 reference); its inputs print as a
`make_inputs(device)` function drawing them from a generator seeded by (seed, index) alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

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


def _input_seed(seed: int, index: int) -> int:
    return (seed * 1_000_003 + index) % (2**31)
