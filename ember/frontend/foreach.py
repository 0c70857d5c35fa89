"""`_foreach_*` ops as one single-tensor op per list element, for the decomposition table.

An optimizer's foreach step (`torch._foreach_mul_(exp_avgs, beta1)`, ...) reaches AOTAutograd as
functional `_foreach_*` ops over lists of tensors. ATen runs each as a loop of launches; ember
decomposes each into its per-tensor op (`aten.mul` on element i of every list argument), so the
step becomes independent pointwise regions the importer lowers and the scheduler fuses, and the
new values AOTAutograd copies back into the state are computed by kernels that can write them in
place. The per-tensor ops are eager's own slow path (ForeachOpsKernels.cpp loops over them), so
type promotion and broadcasting are eager's.
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten

# Foreach ops whose per-tensor op is not the ATen op of the same name (for Scalar operands:
# maximum and minimum have no Scalar overload; eager's foreach path calls clamp_min/clamp_max).
_SCALAR_BASE = {"maximum": aten.clamp_min, "minimum": aten.clamp_max}
# Reductions and products whose foreach forms stay ATen's (no fusion to win, or no per-tensor op).
_KEEP = {"powsum"}


def _length(args) -> int:
    for a in args:
        if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
            return len(a)
    return 0


def _element(arg, i: int):
    """Element i of a list argument (tensors or scalars); any other argument is shared by all."""
    return arg[i] if isinstance(arg, (list, tuple)) else arg


def _per_tensor(name: str, overload: str):
    """The decomposition of `_foreach_<name>.<overload>`: a list of per-tensor results."""
    base = getattr(aten, name)
    if overload in ("Scalar", "ScalarList") and name in _SCALAR_BASE:
        base = _SCALAR_BASE[name]

    positional, keywords = _signature(base)

    def decompose(*args, **kwargs):
        # A foreach op passes positionally what its per-tensor op takes by keyword (addcmul's value).
        kwargs = {**kwargs, **dict(zip(keywords, args[positional:]))}
        args = args[:positional]
        return [
            base(*(_element(a, i) for a in args), **{k: _element(v, i) for k, v in kwargs.items()})
            for i in range(_length(args))
        ]

    return decompose


def _signature(packet) -> tuple[int, list[str]]:
    """The most positional arguments any overload of the op takes, and that overload's keyword-only names."""
    best = (0, [])
    for overload in packet.overloads():
        args = getattr(packet, overload)._schema.arguments
        if overload.endswith("out"):
            continue
        count = sum(1 for a in args if not a.kwarg_only)
        if count > best[0]:
            best = (count, [a.name for a in args if a.kwarg_only])
    return best


def _norm(tensors, ord=2, dtype=None):
    return [aten.linalg_vector_norm(t, ord, dtype=dtype) for t in tensors]


def _zero(tensors):
    return [torch.zeros_like(t) for t in tensors]


def _copy(tensors, src, non_blocking=False):
    # The new value of each destination: src converted to its dtype and device, broadcast to its shape.
    return [s.to(device=t.device, dtype=t.dtype).expand(t.shape).clone() for t, s in zip(tensors, src)]


# Foreach ops whose per-tensor form is not a call of the ATen op of the same name.
_SPECIAL = {"norm": _norm, "zero": _zero, "copy": _copy}


def _tensor_scalars(fn):
    """addcmul/addcdiv with their per-tensor scalars given as one 1-D tensor (`.Tensor` overloads):
    element i of it scales the product of list element i, as eager's `scalars[i].item()` does."""

    def decompose(tensors, tensors1, tensors2, scalars):
        if not tensors:
            return []
        values = scalars.to(device=tensors[0].device)
        return [fn(t, a, b, values[i].to(t.dtype)) for i, (t, a, b) in enumerate(zip(tensors, tensors1, tensors2))]

    return decompose


def _addcmul(t, a, b, value):
    return t + value * a * b


def _addcdiv(t, a, b, value):
    return t + value * (a / b)


@functools.lru_cache(maxsize=1)
def foreach_decompositions() -> dict:
    """OpOverload -> its per-tensor decomposition, for every functional `_foreach_*` overload with one."""
    table = {}
    for schema in torch._C._jit_get_all_schemas():
        qualified = schema.name
        if not qualified.startswith("aten::_foreach_") or qualified.endswith("_"):
            continue
        name = qualified[len("aten::_foreach_") :]
        overload = schema.overload_name or "default"
        if overload.endswith("out") or name in _KEEP:
            continue
        op = getattr(getattr(aten, f"_foreach_{name}"), overload)
        if overload == "Tensor" and name in ("addcmul", "addcdiv"):
            table[op] = _tensor_scalars(_addcmul if name == "addcmul" else _addcdiv)
        elif name in _SPECIAL:
            table[op] = _SPECIAL[name]
        elif hasattr(aten, name):
            table[op] = _per_tensor(name, overload)
    return table
