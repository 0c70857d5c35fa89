"""A graph's schedule on disk, so that compiling the same graph again skips import through scheduling.

A warm start of ResNet-50's training step spent about 5 s of its 25 on the H100 host importing
and scheduling graphs it had scheduled before. The schedule is a pure function of
what the key holds:

- the ATen graph's code (its ops, their arguments and order), every node's shape, strides, dtype
  and device (the importer reads each one's, and fake implementations decide them: a
  convolution's output layout follows cuDNN's flags), and the bytes of every constant it captures
  (16 MiB at most), a captured subgraph (FlexAttention's score and mask functions) described the
  same way;
- the graph's kind, and the target (ember/target.py: Target.key()): what the backend tells the
  passes (what its code generator renders, its SM count and heuristics);
- ember's identity (runtime/cache.py: ember_identity): the settings that change generated code,
  the source of every ember module, and the torch, sympy and Python versions.

Graphs with symbolic sizes anywhere are not cached (their symbols' assumptions live in Dynamo's shape
environment, not in the graph), nor are graphs compiled with `gemm=auto`/`template` (the choice
is measured) or with the passes' own logs on (`EMBER_LOGS=graph,schedule`, `EMBER_DEBUG=3`), which
the cached path would not print.

The schedule is pickled; ATen operators and higher-order operators, which do not pickle, are stored by name and
looked up again. Unpickling runs code from the cache, as loading a cached binary does, so what is unpickled
is exactly the bytes that DiskCache read once and checked (runtime/cache.py): from a root and
folders that are this user's and writable by no one else, through no symbolic link, matching the
entry's manifest. A copy that AOTAutograd's cache keeps lives in torch's folder, which ember does
not vouch for; frontend/aot_cache.py signs it.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field

import sympy
import torch

from ember import config, log
from ember.runtime.cache import DiskCache, content_key


@dataclass(frozen=True)
class KeptSchedule:
    """A graph's schedule as AOTAutograd's cache keeps it (frontend/aot_cache.py): its pickle, the
    device it was compiled for, and the target it was made for (checked again when it is loaded)."""

    pickled: bytes = field(repr=False)
    device: str
    target: tuple  # the Target's key() (ember/target.py): what every pass was told


class _Symbolic(Exception):
    """A meta this key cannot describe by plain values (a SymInt, an unknown object)."""


def _meta(val) -> tuple | int | float | bool | str | None:
    """A node's meta as plain values: a tensor's sizes, strides, offset, dtype and device; a tuple
    of those for several outputs. Raises _Symbolic where a size is symbolic."""
    if isinstance(val, torch.Tensor):
        sizes = (*val.shape, *val.stride(), val.storage_offset())
        if not all(isinstance(s, int) for s in sizes):
            raise _Symbolic
        return (tuple(val.shape), tuple(val.stride()), val.storage_offset(), str(val.dtype), str(val.device))
    if isinstance(val, (list, tuple)):
        return tuple(_meta(v) for v in val)
    if val is None or isinstance(val, (int, float, bool, str, torch.dtype, torch.device)):
        return val if not isinstance(val, (torch.dtype, torch.device)) else str(val)
    raise _Symbolic


# Captured constants are pickled by value and hashed on every compile: a graph holding more than
# this many bytes of them is not cached.
MAX_CONSTANT_BYTES = 16 << 20


def _constant_digest(value) -> tuple | None:
    """A captured constant's meta and the SHA-256 of its bytes; None for anything else."""
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    if not isinstance(value, torch.Tensor) or isinstance(value, FakeTensor) or value.is_meta:
        return None
    if value.layout != torch.strided or value.is_quantized or type(value) is not torch.Tensor:
        return None
    try:
        meta = _meta(value)
        with unset_fake_temporarily():  # compilers run under AOTAutograd's fake mode; these bytes are real
            flat = value.detach().resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    except (_Symbolic, RuntimeError, TypeError):
        return None
    return (meta, len(data), hashlib.sha256(data).hexdigest())


def cacheable_settings() -> bool:
    """Whether the settings in force let a schedule be cached (see the module's docstring)."""
    if not config.get("schedule_cache") or not config.get("cache") or config.get("gemm") != "aten":
        return False
    logs = {name.strip() for name in config.get("logs").split(",")}
    return not (logs & {"graph", "schedule"} or config.get("debug") >= 3)


def schedule_key(gm: torch.fx.GraphModule, kind: str, target: tuple) -> str | None:
    """The key of this graph's schedule, or None where it must not be cached. `target`: what the
    schedule is made for (ember/target.py: Target.key())."""
    if not cacheable_settings():
        return None
    try:
        described = _describe(gm)
    except _Symbolic:
        return None
    if described is None:
        return None
    code, metas, constants, size = described
    if size > MAX_CONSTANT_BYTES:
        return None
    # Deterministic algorithms keep scatters with repeated indices as ATen's (schedule/indexed_store.py).
    deterministic = torch.are_deterministic_algorithms_enabled()
    return content_key("schedule", code, metas, constants, kind, deterministic, target=target, ember=True)


def _describe(gm: torch.fx.GraphModule) -> tuple | None:
    """(code, every node's meta, the captured constants, their bytes) of `gm`, or None where a
    captured value cannot be described. A captured graph (a higher-order op's subgraph:
    FlexAttention's score and mask functions, a branch of `cond`) is described the same way, by its
    own code, metas and constants. Raises _Symbolic where a size is symbolic."""
    metas, constants, size = [], [], 0
    for node in gm.graph.nodes:
        # Every node's meta, not only the inputs': the importer reads each one's shape and strides
        # (extern results, outputs), and a fake implementation (a convolution's output layout
        # under cuDNN's flags, a custom op's) decides them.
        metas.append(_meta(node.meta.get("val")))
        if node.op != "get_attr":
            continue
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.fx.GraphModule):
            inner = _describe(value)
            if inner is None:
                return None
            constants.append((node.target, inner[:3]))
            size += inner[3]
            continue
        digest = _constant_digest(value)
        if digest is None:
            return None
        constants.append((node.target, digest))
        size += digest[1]
    return gm.code, metas, constants, size


def _operator(namespace: str, name: str, overload: str | None):
    packet = getattr(getattr(torch.ops, namespace), name)
    return packet if overload is None else getattr(packet, overload)


def _higher_order(name: str):
    return getattr(torch.ops.higher_order, name)


def _unevaluated(func, args: tuple):
    """A size or index expression rebuilt from the arguments it had: it was simplified when it was
    made, so its arguments are already in their canonical form and order."""
    return func(*args, evaluate=False)


# Expressions rebuilt without sympy's simplification on load. Pickled as sympy pickles them, each is
# made anew through its class, which simplifies again: Add and Mul collect terms, Max and Min compare
# every pair of arguments through the assumptions system. For GPT-2's two training graphs (12
# layers) that was 0.1-0.2 s of a warm start; rebuilt as they were, 0.02 s.
_SYMPY_OPS = (sympy.Add, sympy.Mul, sympy.Pow, sympy.Max, sympy.Min, sympy.Function)


class _SchedulePickler(pickle.Pickler):
    def reducer_override(self, obj):
        if isinstance(obj, torch._ops.OpOverload):
            namespace, name = obj._schema.name.split("::", 1)
            return _operator, (namespace, name, obj._overloadname)
        if isinstance(obj, torch._ops.OpOverloadPacket):
            namespace, name = obj._qualified_op_name.split("::", 1)
            return _operator, (namespace, name, None)
        if isinstance(obj, torch._ops.HigherOrderOperator):  # flex_attention's, cond's: by name
            return _higher_order, (obj.name(),)
        if isinstance(obj, _SYMPY_OPS) and obj.args:
            # Only where rebuilding gives this very expression (its class and arguments), checked
            # here; anything else is pickled as sympy does.
            rebuilt = _unevaluated(obj.func, obj.args)
            if type(rebuilt) is type(obj) and rebuilt == obj:
                return _unevaluated, (obj.func, obj.args)
        return NotImplemented


def dumps(schedule) -> bytes:
    """The pickled schedule. The graph's nodes are pickled in order, each after the values it
    reads, so the pickler's recursion stays shallow (ResNet-50's training graphs fit Python's
    default limit); a RecursionError would only leave the schedule uncached (`save`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    buffer = io.BytesIO()
    with unset_fake_temporarily():
        _SchedulePickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(schedule)
    return buffer.getvalue()


def loads(blob: bytes):
    """The schedule again. Outside AOTAutograd's fake mode, which compilers run under: a captured
    constant rebuilt inside it would be a fake tensor with no memory behind its data pointer.

    With the cyclic garbage collector paused: unpickling makes tens of thousands of containers, none
    of them garbage, and every 700 of them start a collection, every hundredth of which looks at the
    whole heap: in a process that has imported Dynamo, some 400,000 objects (0.1-0.4 s each on a
    2-core CPU; a GPT-2 schedule of 500 KB took 0.02 s to unpickle paused, up to 0.4 s not). Paused,
    the new objects are looked at once, by the first young collection after."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily(), _collector_paused():
        return pickle.loads(blob)  # bytes the caller verified: a checked cache entry, or a signed copy


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the block (as it was, after: a caller may have it off)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def load(key: str) -> tuple | None:
    """(the schedule stored under `key`, its pickle), or None: absent, damaged, or unreadable."""
    entry = DiskCache().get("schedule", key)
    if entry is None:
        return None
    try:
        blob = entry["schedule.pickle"]  # the bytes the cache read once and checked, not the file again
        return loads(blob), blob
    except Exception as e:  # noqa: BLE001 - any failure to load is a miss: the graph is scheduled again
        log.artifact("cache", "schedule", f"{entry.path}: not loaded ({type(e).__name__}: {e})"[:300])
        return None


def save(key: str, schedule) -> bytes | None:
    """Store the schedule under `key`; returns its pickle, or None where it does not pickle."""
    try:
        blob = dumps(schedule)
    except Exception as e:  # noqa: BLE001 - a schedule that does not pickle is compiled, just not cached
        log.artifact("cache", "schedule", f"not cached ({type(e).__name__}: {e})"[:300])
        return None
    DiskCache().put("schedule", key, {"schedule.pickle": blob})
    return blob
