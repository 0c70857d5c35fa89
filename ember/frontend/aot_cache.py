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
ember adds its own part through `torch.compiler.config.cache_key_tag`: ember's source hash, its
settings, and its cache folder (a test pointing ember at an empty folder means an empty cache).
Used only where the schedule cache is (`schedule_cache` and `cache` on, `gemm=aten`, no pass logs
asked for); a graph ember ran eagerly, or whose schedule it would not cache (symbolic sizes), is
not saved (`BypassAOTAutogradCache`).

This leans on AOTAutograd's private API, the same in torch 2.11 and 2.13: `OutputCode`'s four
methods, `bundled_autograd_cache`, `force_non_lazy_backward_lowering` (the backward is compiled
with the forward, so the entry is saved while these settings are in force), `cache_key_tag`. A
failure to save only logs a warning in torch; a failure to load makes AOTAutograd compile anew.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch._inductor.output_code import OutputCode

from ember import config


def enabled() -> bool:
    from ember.runtime.schedule_cache import cacheable_settings

    return cacheable_settings()


@dataclasses.dataclass
class EmberGraphCode(OutputCode):
    """One compiled graph as AOTAutograd's cache keeps it: the live program while it runs, its
    schedule's pickle while it is stored."""

    kind: str = ""
    device: str = ""
    num_nodes: int = 0
    options: dict = dataclasses.field(default_factory=dict)
    schedule_blob: bytes | None = None
    program: Any = None  # the CompiledGraph; never pickled

    def __post_init__(self) -> None:
        self._boxed_call = True  # an instance attribute: see pipeline.CompiledGraph

    def __call__(self, inputs: Any) -> Any:
        return self.program(inputs)

    @property
    def report(self):
        return getattr(self.program, "report", None)

    def prepare_for_serialization(self) -> None:
        # Called on a shallow copy that AOTAutograd then pickles.
        if self.schedule_blob is None:
            from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache

            raise BypassAOTAutogradCache(f"ember: the {self.kind} graph has no schedule to keep")
        self.program = None

    def post_compile(self, example_inputs: Any, constants: Any, graph_kwargs: Any) -> None:
        if self.program is not None:
            return  # a fresh compile: the program is live
        from ember.pipeline import compile_from_schedule
        from ember.runtime.schedule_cache import loads

        # The settings of the compile that loads it: the stored ones are the saving compile's, which
        # agree on everything in the key but may differ in what only logs (debug, logs, strict).
        options = getattr(_loading, "options", None)
        with config.override(**(self.options if options is None else options)):
            start = time.perf_counter()
            sched = loads(self.schedule_blob)
            self.program = compile_from_schedule(
                sched, self.kind, torch.device(self.device), self.num_nodes, time.perf_counter() - start
            )

    def set_triton_bundle(self, triton_bundle: Any) -> None:
        pass  # ember's kernels live in its own cache


def wrap(program: Any, gm: torch.fx.GraphModule, kind: str, options: dict) -> EmberGraphCode:
    """The OutputCode of one compiled graph (a CompiledGraph or ember's eager fallback)."""
    from ember.runtime.schedule_cache import dumps

    sched = getattr(program, "schedule", None)
    blob = None
    if sched is not None:
        with contextlib.suppress(Exception):  # one that does not pickle is just not kept
            blob = dumps(sched)
    device = str(sched.graph.device) if sched is not None else "cpu"
    num_nodes = sum(1 for n in gm.graph.nodes if n.op == "call_function")
    return EmberGraphCode(
        kind=kind, device=device, num_nodes=num_nodes, options=options, schedule_blob=blob, program=program
    )


def serializable(compile_fn):
    """`compile_fn` (gm, example_inputs) -> EmberGraphCode, as a compiler AOTAutograd may cache."""
    from torch._functorch._aot_autograd.schemas import SerializableAOTDispatchCompiler

    return SerializableAOTDispatchCompiler(EmberGraphCode, compile_fn)


_loading = threading.local()  # the options of the compile in progress (in_force)


@contextlib.contextmanager
def in_force(options: dict) -> Iterator[None]:
    """AOTAutograd's settings for a bundled cache of ember's graphs, and ember's part of the key."""
    from torch._functorch import config as functorch_config

    from ember.runtime.cache import content_key
    from ember.runtime.schedule_cache import ember_key

    with config.override(**options):
        tag = content_key(ember_key(), config.get("cache_dir"))
    old = torch.compiler.config.cache_key_tag
    with (
        functorch_config.patch(
            enable_autograd_cache=True, bundled_autograd_cache=True, force_non_lazy_backward_lowering=True
        ),
        torch.compiler.config.patch(cache_key_tag=f"{old}|ember:{tag}"),
    ):
        outer = getattr(_loading, "options", None)
        _loading.options = options
        try:
            yield
        finally:
            _loading.options = outer
