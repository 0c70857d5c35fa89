"""AOTAutograd's own cache for ember's graphs: a warm start skips AOTAutograd too.

With ember's caches warm (schedules, kernel modules, launch records), ResNet-50's training step
still spent about 12 s of a 15 s first step in Dynamo and AOTAutograd on the H100 host: tracing
the joint graph through the decompositions and partitioning it, every start. Inductor's warm
start skips that part through AOTAutograd's cache, which keys an entry by the Dynamo graph and its
inputs and stores what the compilers returned. A compiler takes part by being a
`SerializableAOTDispatchCompiler` whose results are `OutputCode`s; in the "bundled" mode the
entry pickles those objects themselves. `EmberGraphCode` is ember's: it keeps the graph's pickled
schedule (runtime/schedule_cache.py), and on a hit `post_compile` builds the kernels and the host
program from it (pipeline.compile_from_schedule).

AOTAutograd's key knows nothing of ember (not its decompositions, partitioner or settings), so
ember adds its own part through `torch.compiler.config.cache_key_tag`, a key of runtime/cache.py's
recipe: ember's identity (its source, the settings that change generated code, versions), the
cache's random name for its entries (`aot-id` in ember's cache folder: `ember cache clear` makes a
new one, orphaning them; a cache file imported brings its own, frontend/cache_file.py), and the
state torch 2.11's key leaves out (autocast dtypes, default dtype, cuDNN and TF32 flags, SDPA's
enabled kernels, their priority and the math kernel's reduced-precision flag). The target a
schedule was made for is stored with it and checked on a hit. Used only
where the schedule cache is (`schedule_cache` and `cache` on, `gemm=aten`, no pass logs asked for),
where ember's cache folder is usable, and where the Dynamo graph captures no tensor constant; a
graph ember ran eagerly, or whose schedule it would not cache (symbolic sizes), is not saved
(`BypassAOTAutogradCache`).

Integrity. The entry lives in torch's cache folder, which ember does not vouch for: another user
may have made it, and a flipped bit in a pickled constant would be a wrong answer in every later
process. So ember signs what it stores (the schedule's pickle and the fields that say how to build
it) with an HMAC-SHA256 under a random key kept in ember's own cache folder (`aot-key`: 0600,
read through the checks of runtime/cache.py), and checks the signature before unpickling the
schedule; an entry that does not match is not loaded, and the graph is compiled anew. Each entry
saved also leaves a voucher in ember's cache (kind `vouch`: the SHA-256 of what was signed), which
a cache file carries to another machine, whose key differs: there an entry is loaded if its
signature matches or a voucher names it (`_trusted`). (The rest of the entry is AOTAutograd's,
unpickled by torch before ember sees it.)

This leans on AOTAutograd's private API, the same in torch 2.11 and 2.13: `OutputCode`'s four
methods, `bundled_autograd_cache`, `force_non_lazy_backward_lowering` (the backward is compiled
with the forward, so the entry is saved while these settings are in force), `cache_key_tag`, and
Inductor's `codecache.init_backend_registration` and backend registries, which ember's graphs are keyed
without (`_without_inductor_backends`), and its `torch_key` and `CacheBase.get_system`, for which ember
puts torch's and Triton's versions (`_identify_by_versions`). A
failure to save only logs a warning in torch; a failure to load makes AOTAutograd compile anew.
AOTAutograd calls `prepare_for_serialization` and `post_compile` with nothing of ember's, so what
they need of the compile in progress (its options, signing key, and the graphs it loaded) is a
`_Compile` record that `in_force` makes current for its duration (a context variable).
"""

from __future__ import annotations

import collections.abc
import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import hmac
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch._inductor.output_code import OutputCode

from ember import config, faults, log
from ember.runtime.schedule_cache import KeptSchedule


@dataclasses.dataclass
class EmberGraphCode(OutputCode):
    """One compiled graph as AOTAutograd's cache keeps it: the live program while it runs, its
    schedule's pickle while it is stored."""

    kind: str = ""
    num_nodes: int = 0
    options: dict = dataclasses.field(default_factory=dict)
    schedule: KeptSchedule | None = None  # None: nothing to keep (an eager fallback, symbolic sizes)
    # (static input positions, runtime/cudagraphs.CaptureFacts) of a graph the default mode may record.
    capture: tuple | None = None
    signature: bytes = dataclasses.field(default=b"", repr=False)  # HMAC of the above under ember's key
    program: Any = dataclasses.field(default=None, repr=False)  # the CompiledGraph; never pickled

    def __post_init__(self) -> None:
        self._boxed_call = True  # an instance attribute: see pipeline.CompiledGraph

    def __call__(self, inputs: Any) -> Any:
        return self.program(inputs)

    def prepare_for_serialization(self) -> None:
        # Called on a shallow copy that AOTAutograd then pickles.
        from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

        if self.schedule is None:
            raise BypassAOTAutogradCache(f"ember: the {self.kind} graph has no schedule to keep")
        current = _current.get()
        key = current.key if current is not None else None
        if key is None:
            raise BypassAOTAutogradCache("ember: no key to sign the graph with")
        if faults.armed("aot_sign") is not None:
            key = b"not ember's key"  # a testing aid: an entry planted by someone without the key
        self.signature = _signature(key, self)
        self.program = None
        if faults.armed("aot_sign") is None:
            _vouch(self)

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        if self.program is not None:
            return  # a fresh compile: the program is live
        from ember.pipeline import compile_from_schedule
        from ember.runtime.schedule_cache import loads

        # The settings of the compile that loads it: the stored ones are the saving compile's, which
        # agree on everything in the key but may differ in what only logs (debug, logs, strict).
        current = _current.get()
        try:
            with config.override(**(self.options if current is None else current.options)):
                start = time.perf_counter()
                key = _signing_key() if current is None else current.key
                kept = self.schedule
                if kept is None or key is None or not _trusted(key, self):
                    # Checked before unpickling: the pickle runs code.
                    raise ValueError(
                        "its signature does not match ember's key: the entry is damaged, or was not "
                        "written by ember with this cache folder"
                    )
                sched = loads(kept.pickled)
                self.program = compile_from_schedule(
                    sched,
                    self.kind,
                    torch.device(kept.device),
                    self.num_nodes,
                    time.perf_counter() - start,
                    kept.target,
                    publish=current is None,
                )
                if self.capture is not None:
                    from ember.runtime.cudagraphs import graphed_as_set

                    self.program = graphed_as_set(self.program, self.kind, self.capture)
        except Exception as e:
            # AOTAutograd catches this, logs it at INFO and compiles the graph anew: say so louder.
            article = "an" if self.kind[:1] in "aeiou" else "a"
            log.warn(
                f"ember: {article} {self.kind} graph from AOTAutograd's cache did not load, compiling it anew: "
                f"{type(e).__name__}: {e}"[:500]
            )
            raise
        if current is not None:
            current.loaded.append(self.program)

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # ember's kernels live in its own cache


def wrap(
    program: Any, gm: torch.fx.GraphModule, kind: str, options: dict, capture: tuple | None = None
) -> EmberGraphCode:
    """The OutputCode of one compiled graph (a CompiledGraph, ember's eager fallback, or either under
    the default mode's CUDA graphs, whose facts `capture` holds)."""
    kept = getattr(program, "kept", None)  # a KeptSchedule, or None
    if hasattr(program, "kept"):
        program.kept = None  # the entry holds it from here
    current = _current.get()
    if current is not None:
        # A graph compiled anew: AOTAutograd missed or dropped its entry, and with it whatever
        # this compile loaded before (in_force publishes those reports only if nothing was compiled).
        current.compiled_anew.append(kind)
    if kind == "backward":
        _no_donated_buffers()
    num_nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return EmberGraphCode(
        kind=kind, num_nodes=num_nodes, options=options, schedule=kept, capture=capture, program=program
    )


def _no_donated_buffers() -> None:
    """Clear the backward's donated buffers in AOTAutograd's metadata of the compile in progress.

    AOTAutograd forgets them itself when it compiles a backward lazily under create_graph=True (a
    gradient penalty's first grad), which then runs, and only a double backward is refused, with
    AOTAutograd's own "does not currently support double backward" (Inductor's behaviour). Compiled
    with the forward (`force_non_lazy_backward_lowering`), it keeps them and refuses that first grad
    with a hint to turn donated buffers off, which leads to the same refusal one step later. ember's
    memory plan never writes into a backward's inputs, so it donates nothing."""
    from torch._guards import TracingContext

    context = TracingContext.try_get()
    meta = getattr(context, "fw_metadata", None)
    if meta is not None and getattr(meta, "bw_donated_idxs", None):
        meta.bw_donated_idxs = []


def serializable(compile_fn):
    """`compile_fn` (gm, example_inputs) -> EmberGraphCode, as a compiler AOTAutograd may cache."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    return SerializableAOTDispatchCompiler(EmberGraphCode, compile_fn)


def usable(gm: torch.fx.GraphModule) -> bool:
    """AOTAutograd's cache for this compile: where ember would cache the schedules, where this
    torch has what this module uses, and where the Dynamo graph captures no tensor constant
    (AOTAutograd's key holds a captured tensor's shape, not its values)."""
    from ember.runtime.schedule_cache import cacheable_settings

    if not config.get("aot_cache") or not cacheable_settings() or _signing_key() is None:
        return False  # without ember's own usable cache, nothing to sign or check entries with
    if not _torch_cache_is_private():
        return False
    try:
        from torch._functorch import config as functorch_config
        from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler  # noqa: F401
    except ImportError:
        return False
    if not all(hasattr(functorch_config, f) for f in ("bundled_autograd_cache", "force_non_lazy_backward_lowering")):
        return False
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(_attribute(gm, node.target), torch.Tensor):
            return False
    return True


def _torch_cache_is_private() -> bool:
    """Whether torch's cache folder and its AOTAutograd folder are this user's alone (made 0700
    here where missing). torch unpickles its own part of an entry before ember's signature is
    checked, and its folder defaults to /tmp/torchinductor_<user>, a name another user can create
    first: where they could write there, AOTAutograd's cache is not used at all."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return _private_folder(cache_dir())


@functools.cache
def _private_folder(root: str) -> bool:
    """_torch_cache_is_private for the folder `root`, checked once per process: who owns a folder
    and who may write it changes only by someone's deliberate act (chown, chmod, a new folder
    under the same name), not in the course of compiling, and the filesystem checks cost every
    compile otherwise. A refused folder warns once, here."""
    from ember.runtime import safe_fs

    try:
        aot = os.path.join(root, "aotautograd")
        with safe_fs.open_root(Path(root), create=True) as (fd, _), safe_fs.open_folder(fd, "aotautograd", aot, True):
            return True
    except OSError as e:
        log.warn(f"ember: not using AOTAutograd's cache: {e}; compiling without it")
        return False


def _attribute(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


@dataclasses.dataclass(frozen=True)
class _Compile:
    """The compile in progress under `in_force`: its options and signing key (None: nothing is
    saved, nothing loads); the programs built from AOTAutograd's cache, and the kinds of the graphs
    compiled anew (any at all: AOTAutograd discarded the loaded ones)."""

    options: dict
    key: bytes | None = dataclasses.field(repr=False)
    loaded: list = dataclasses.field(default_factory=list)
    compiled_anew: list[str] = dataclasses.field(default_factory=list)


# The compile in progress in this thread (contexts are per thread): in_force sets it.
_current: contextvars.ContextVar[_Compile | None] = contextvars.ContextVar("ember_aot_compile", default=None)


def aot_id() -> bytes | None:
    """The random name of this cache's AOTAutograd entries, part of their key (ember's cache folder
    keeps it, `aot-id`); None where that folder is off or cannot be trusted."""
    from ember.runtime.cache import DiskCache

    return DiskCache().secret("aot-id", 16)


def _signing_key() -> bytes | None:
    """The key that signs ember's part of AOTAutograd's entries, from ember's cache folder (made
    there on first use); None where that folder is off or cannot be trusted."""
    from ember.runtime.cache import DiskCache

    return DiskCache().secret("aot-key")


def _signed(code: EmberGraphCode) -> list[bytes]:
    """Everything post_compile builds from, as the bytes that are signed."""
    kept = code.schedule
    parts = (code.kind, code.num_nodes, sorted(code.options.items()), kept.device, kept.target, code.capture)
    return [repr(part).encode() + b"\0" for part in parts] + [kept.pickled]


def _signature(key: bytes, code: EmberGraphCode) -> bytes:
    """HMAC-SHA256 of everything post_compile builds from."""
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in _signed(code):
        mac.update(part)
    return mac.digest()


def _digest(code: EmberGraphCode) -> str:
    h = hashlib.sha256()
    for part in _signed(code):
        h.update(part)
    return h.hexdigest()


def _vouch(code: EmberGraphCode) -> None:
    """Record in ember's own cache that it wrote this entry (its signed content's SHA-256): a
    voucher, which a cache file carries to another machine, where the entry's signature (under
    this machine's key) cannot match."""
    from ember.runtime.cache import DiskCache

    digest = _digest(code)
    DiskCache().put("vouch", digest, {"signed.sha256": digest.encode()})


def _trusted(key: bytes, code: EmberGraphCode) -> bool:
    """Whether ember wrote this entry: signed under this cache's key, or vouched for in this cache
    (an entry imported from a cache file, runtime/portable.py). Checked before anything is unpickled."""
    if hmac.compare_digest(code.signature, _signature(key, code)):
        return True
    from ember.runtime.cache import DiskCache

    return DiskCache().get("vouch", _digest(code)) is not None


def _state_tag() -> tuple:
    """What changes ember's graphs but not AOTAutograd's key on every supported torch: the autocast
    dtypes (torch 2.11's key holds only whether autocast is on) and the default dtype, cuDNN's
    flags (a convolution's output layout), TF32 settings, and SDPA's enabled kernels, their priority
    order and the math kernel's reduced-precision reductions (which kernel, and which ops, the trace
    names)."""
    autocast = tuple((d, torch.is_autocast_enabled(d), str(torch.get_autocast_dtype(d))) for d in ("cpu", "cuda"))
    cudnn = torch.backends.cudnn
    return (
        autocast,
        str(torch.get_default_dtype()),
        (cudnn.enabled, cudnn.benchmark, cudnn.deterministic, cudnn.allow_tf32),
        torch.backends.cuda.matmul.allow_tf32,
        tuple(getattr(torch._C, f"_get_{name}_sdp_enabled")() for name in ("cudnn", "flash", "mem_efficient", "math")),
        tuple(torch._C._get_sdp_priority_order()),
        torch._C._get_math_sdp_allow_fp16_bf16_reduction(),
    )


_in_force = contextvars.ContextVar("ember_aot_compile", default=False)  # an ember compile under AOTAutograd's cache
_keying = contextvars.ContextVar("ember_aot_keying", default=False)  # ... computing AOTAutograd's key


@contextlib.contextmanager
def _without_inductor_backends() -> Iterator[None]:
    """While AOTAutograd keys ember's graphs, the key holds nothing of Inductor's code generators. The key
    (Inductor's `FxGraphHashDetails`) registers every device backend of Inductor first and hashes the custom
    passes and settings they bring: that imports Inductor's schedulers and lowerings, 1.4 s of a warm start on
    the 2-core CPU machine, for code ember's graphs never run. On this thread, while AOTAutograd's
    `autograd_cache_key` runs inside an ember compile, the registration is skipped and the registries read
    empty, so a graph's key is the same in a process that has run Inductor (its backends registered) and in
    one that has not: a cache file exported from the one is found by the other. Anything else on the thread
    (Inductor's own keys) sees the registries as they are."""
    from torch._functorch._aot_autograd import autograd_cache
    from torch._inductor import codecache

    register = getattr(codecache, "init_backend_registration", None)
    key = getattr(autograd_cache, "autograd_cache_key", None)
    if register is None or key is None:
        yield
        return
    # Each installed once (and again where something replaced it since).
    if not getattr(key, "gated_by_ember", False):
        autograd_cache.autograd_cache_key = _keyed(key)
    if not getattr(register, "gated_by_ember", False):
        codecache.init_backend_registration = _gated(register)
    _identify_by_versions(codecache)
    for name in ("custom_backend_passes", "custom_backend_codegen_configs"):
        registry = getattr(codecache, name, None)
        if isinstance(registry, dict):
            setattr(codecache, name, _HiddenWhileKeying(registry))
    token = _in_force.set(True)
    try:
        yield
    finally:
        _in_force.reset(token)


def _keyed(key):
    """AOTAutograd's `autograd_cache_key`, flagged on this thread while it keys an ember compile's graph."""

    @functools.wraps(key)
    def keyed(*args, **kwargs):
        if not _in_force.get():
            return key(*args, **kwargs)
        token = _keying.set(True)
        try:
            return key(*args, **kwargs)
        finally:
            _keying.reset(token)

    keyed.gated_by_ember = True
    return keyed


def _identify_by_versions(codecache) -> None:
    """While an ember graph is keyed, torch and Triton are identified by their versions, as every
    other key of ember's is (runtime/cache.py: ember_identity, triton_identity), not by Inductor's
    hashes of their installed files: `torch_key` reads and hashes torch's Python sources and
    `CacheBase.get_system` Triton's (`triton_key`), 0.6 s of every process's first step on the
    2-core CPU machine, warm starts included, where a cache hit is meant to take none. What is not
    told apart: a torch or Triton edited in place under the same version string."""
    torch_key = getattr(codecache, "torch_key", None)
    if torch_key is not None and not getattr(torch_key, "gated_by_ember", False):
        codecache.torch_key = _while_keying(torch_key, _torch_identity)
    base = getattr(codecache, "CacheBase", None)
    get_system = getattr(base, "get_system", None) if base is not None else None
    if get_system is not None and not getattr(get_system, "gated_by_ember", False):
        base.get_system = staticmethod(_while_keying(get_system, _system_identity))


def _while_keying(original, instead):
    """`original`, answered by `instead` while an ember compile's graph is keyed on this thread."""

    @functools.wraps(original)
    def gated(*args, **kwargs):
        return instead() if _keying.get() else original(*args, **kwargs)

    gated.gated_by_ember = True
    return gated


@functools.cache
def _torch_identity() -> bytes:
    return repr(("torch", torch.__version__, torch.version.git_version)).encode()


@functools.cache
def _system_identity() -> dict:
    """What Inductor's `CacheBase.get_system` says (the GPU's name, the CUDA and Triton versions), with
    Triton named as ember's kernel keys name it."""
    from ember.runtime.cache import triton_identity

    device: dict = {"name": None}
    versions: dict = {"cuda": torch.version.cuda, "hip": torch.version.hip}
    try:
        versions["triton"] = repr(triton_identity())
    except ImportError:
        versions["triton"] = None
    try:
        if torch.cuda.is_available():
            properties = torch.cuda.get_device_properties(torch.cuda.current_device())
            device["name"] = properties.name if torch.version.cuda is not None else properties.gcnArchName
    except (AssertionError, RuntimeError):
        pass  # as Inductor's get_system: no usable CUDA, no device name
    described = repr(sorted({**device, **versions}.items()))
    return {"device": device, "version": versions, "hash": hashlib.sha256(described.encode()).hexdigest()}


def _gated(register):
    """Inductor's `init_backend_registration`, skipped while an ember compile's graph is keyed on this thread."""

    @functools.wraps(register)
    def gated() -> None:
        if not _keying.get():
            register()

    gated.gated_by_ember = True
    return gated


class _HiddenWhileKeying(collections.abc.Mapping):
    """One of Inductor's backend registries as the cache key reads it: empty while an ember compile's graph is
    keyed on this thread, the registry itself otherwise (registration writes to the registry, not through this)."""

    def __init__(self, registry: dict):
        self.registry = registry

    def __getitem__(self, key):
        if _keying.get():
            raise KeyError(key)
        return self.registry[key]

    def __iter__(self):
        return iter(()) if _keying.get() else iter(self.registry)

    def __len__(self) -> int:
        return 0 if _keying.get() else len(self.registry)


@contextlib.contextmanager
def in_force(options: dict) -> Iterator[None]:
    """AOTAutograd's settings for a bundled cache of ember's graphs, and ember's part of the key.
    The settings are process-wide: a compile on another thread meanwhile sees them too."""
    from torch._functorch import config as functorch_config

    from ember.pipeline import publish_loaded
    from ember.runtime.cache import content_key

    with config.override(**options):
        key = _signing_key()
        # This cache's name for its entries (aot-id): a cache cleared gets a new one, orphaning them;
        # a cache file imported (runtime/portable.py) brings its own, so that its entries are found.
        name = aot_id()
        tag = content_key("aot", name.hex() if key and name else "none", _state_tag(), ember=True)
    old = torch.compiler.config.cache_key_tag
    current = _Compile(options, key)
    with (
        functorch_config.patch(bundled_autograd_cache=True, force_non_lazy_backward_lowering=True),
        torch.compiler.config.patch(cache_key_tag=f"{old}|ember:{tag}"),
        _without_inductor_backends(),
    ):
        token = _current.set(current)
        try:
            yield
        finally:
            _current.reset(token)
    if not current.compiled_anew:  # every graph came from the cache: now their reports count
        with config.override(**options):
            publish_loaded(current.loaded)
