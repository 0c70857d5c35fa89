"""The torch.compile backend: `torch.compile(model, backend="ember")`.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so Dynamo finds
it without `import ember`. Dynamo hands us a Torch-level FX graph; AOTAutograd, with ember's
decomposition table, turns it into functional ATen graphs (inference, or forward and
backward), and each one goes through ember's pipeline.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch

from ember import config, log, progress
from ember.frontend.recompiles import explained
from ember.signals import dynamo_control_flow

# torch.compile's modes are accepted so code written for Inductor runs unchanged. Each one means
# the settings it maps to (as in Inductor, max-autotune includes CUDA graphs); ember has no
# autotuning of its own kernels, so that part of max-autotune changes nothing. Options the caller
# names win over their mode's.
MODE_SETTINGS: dict[str | None, dict[str, Any]] = {
    None: {},
    "default": {},
    "reduce-overhead": {"cudagraphs": True},
    # Tuning: each kernel's launch measured (autotune), and ATen's matrix products against ember's
    # GEMM template with its fused epilogue (gemm=auto).
    "max-autotune": {"cudagraphs": True, "autotune": True, "gemm": "auto"},
    "max-autotune-no-cudagraphs": {"cudagraphs_default": False, "autotune": True, "gemm": "auto"},
}
KNOWN_MODES = tuple(MODE_SETTINGS)


def _compiler(kind: str, options: dict[str, Any], cached: bool, fell_back: list[str]):
    """The compiler of one graph kind; `cached`: one whose results AOTAutograd's cache may keep
    (frontend/aot_cache.py). Each graph ember runs eagerly appends its kind to `fell_back`."""

    def compile_one(gm: torch.fx.GraphModule, example_inputs):
        from ember.frontend.attention_backward import check_traced
        from ember.frontend.freezing import FrozenGraph
        from ember.pipeline import EagerGraph, compile_graph

        # The backward graph is compiled lazily, after torch.compile returned: re-enter the
        # caller's options here so they apply to it too.
        with config.override(**options):
            check_traced(gm, kind)
            if kind == "inference" and config.get("channels_last"):
                _channels_last(gm, example_inputs)
            if config.get("conv_bias_epilogue"):
                _conv_bias_epilogue(gm, example_inputs, kind)
            if config.get("constant_fold") and not (kind == "backward" and fell_back):
                _fold_constants(gm, kind)
            if kind == "backward" and fell_back:
                # Compiled with the forward (for AOTAutograd's cache) after the forward fell back:
                # Dynamo's graph runs in their place (_dynamo_graph_if_eager); this one never runs.
                program = gm
            elif kind == "inference" and config.get("freezing"):
                program = _frozen(gm, example_inputs)
            else:
                program = compile_graph(gm, example_inputs, kind, keep_schedule=cached)
            if isinstance(program, EagerGraph) or isinstance(getattr(program, "program", None), EagerGraph):
                fell_back.append(kind)  # (a FrozenGraph's main graph too: Dynamo's graph runs in its place)
            capture = None if isinstance(program, FrozenGraph) else _capture(gm, example_inputs, kind)
            if capture is not None:
                from ember.runtime.cudagraphs import graphed_as_set

                program = graphed_as_set(program, kind, capture)
        progress.stage("AOTAutograd")  # back in AOTAutograd: partitioning, tracing the backward
        if not cached:
            return program
        from ember.frontend import aot_cache

        return aot_cache.wrap(program, gm, kind, options, capture)

    if not cached:
        return compile_one
    from ember.frontend import aot_cache

    return aot_cache.serializable(compile_one)


def _capture(gm: torch.fx.GraphModule, example_inputs, kind: str) -> tuple | None:
    """(static input positions, CaptureFacts) of a graph CUDA graphs may record: every graph under
    `cudagraphs` (which refuses the others with their reason), else those on the recorder's device,
    whatever `cudagraphs_default` says (AOTAutograd's cache entry keeps them, and a later compile that
    loads it may have the setting on). None: neither applies."""
    from ember.pipeline import graph_device, select_backend
    from ember.runtime.cudagraphs import capture_facts, copied_below, current_recorder, static_inputs

    device = graph_device(gm, example_inputs)
    if not config.get("cudagraphs") and device.type != current_recorder().device_type:
        return None
    target = select_backend(device).target()
    share = target.heuristics.graphs.default_copy_percent / 100
    facts = capture_facts(gm, device, copied_below(kind), share, target.bandwidth)
    return tuple(static_inputs(gm, kind)), facts


def _channels_last(gm: torch.fx.GraphModule, example_inputs) -> None:
    """An inference graph with its convolutions on channels-last inputs (frontend/layout.py): on the CPU
    before freezing, whose prologue then converts their weights once, or packs them; on a GPU with their
    weights converted in the graph (where autocast casts them, by the cast's own kernel). A failure leaves
    the graph as it was."""
    from ember.frontend import prepack
    from ember.frontend.layout import to_channels_last
    from ember.pipeline import graph_device

    device = graph_device(gm, example_inputs).type
    if device not in ("cpu", "cuda"):
        return
    try:
        if device == "cuda":
            to_channels_last(gm, convert_weights=True)
            return
        packed = config.get("freezing") and config.get("prepack") and prepack.available()
        to_channels_last(gm, convert_weights=config.get("freezing") and not packed, weights_packed=packed)
    except Exception as e:
        if config.get("strict"):
            raise
        log.warn(f"ember: channels-last convolutions skipped for an inference graph: {type(e).__name__}: {e}")


def _conv_bias_epilogue(gm: torch.fx.GraphModule, example_inputs, kind: str) -> None:
    """A CUDA graph's convolution biases added, and in a backward their gradients summed, by ember's
    kernels (frontend/conv_bias.py). A failure leaves each convolution whole, rewritten or as it was."""
    from ember.frontend.conv_bias import peel_bias, sum_bias_gradients
    from ember.pipeline import graph_device

    if graph_device(gm, example_inputs).type != "cuda":
        return
    try:
        if kind == "backward":
            sum_bias_gradients(gm)
        else:
            peel_bias(gm)
    except Exception as e:
        if config.get("strict"):
            raise
        log.warn(f"ember: convolution biases left to cuDNN in a graph: {type(e).__name__}: {e}")


def _fold_constants(gm: torch.fx.GraphModule, kind: str) -> None:
    """The graph's values that depend on no input, computed now (frontend/constant_fold.py). A failure
    leaves the graph as it was."""
    from ember.frontend.constant_fold import copy_saved_gradients, fold_constants
    from ember.runtime.cudagraphs import copied_below

    try:
        if kind == "backward":
            copy_saved_gradients(gm)
            return
        folded = fold_constants(gm, copied_below(kind))  # a forward's user outputs; every one elsewhere
    except Exception as e:
        if config.get("strict"):
            raise
        what = "gradients that are saved tensors not copied" if kind == "backward" else "constants left computed"
        log.warn(f"ember: {what} in a {kind} graph: {type(e).__name__}: {e}")
        return
    if folded:
        log.artifact("graph", f"{kind} graph", f"{folded} values computed from constants alone folded")


def _frozen(gm: torch.fx.GraphModule, example_inputs):
    """An inference graph under `freezing` (frontend/freezing.py): its computations over parameters and
    buffers split off into a prologue, the rest compiled. Under CUDA graphs, whose recordings keep
    the addresses of the prologue's results, the graph is compiled whole."""
    from ember.frontend.freezing import FrozenGraph, freeze
    from ember.pipeline import compile_graph, graph_device, select_backend

    context = torch._guards.TracingContext.try_get()
    static = list(getattr(getattr(context, "fw_metadata", None), "static_input_indices", None) or ())
    graphed = graph_device(gm, example_inputs).type == "cuda" and (
        config.get("cudagraphs") or config.get("cudagraphs_default")
    )
    split = None
    if not graphed and static:
        try:
            # The CPU target's choices and measured facts (only CPU convolutions and products are packed or
            # laid out for ember's kernels).
            device = graph_device(gm, example_inputs)
            target = select_backend(device).target() if device.type == "cpu" else None
            split = freeze(gm, example_inputs, static, pack_convolutions=config.get("prepack"), target=target)
        except Exception as e:
            if config.get("strict"):
                raise
            log.warn(f"ember: freezing skipped for an inference graph: {type(e).__name__}: {e}")
    if split is None:
        return compile_graph(gm, example_inputs, "inference")
    return FrozenGraph(compile_graph(split.main, split.main_inputs, "inference"), split)


def _checked_options(mode: str | None, options: dict | None) -> dict[str, Any]:
    """The caller's options, parsed; raises ConfigError on a bad mode, option or EMBER_* variable."""
    if mode not in KNOWN_MODES:
        raise config.ConfigError(f"unknown mode {mode!r}; valid: {', '.join(m for m in KNOWN_MODES if m)}")
    options = config.validate({**MODE_SETTINGS[mode], **(options or {})}, "torch.compile options")
    config.check_environment()
    return options


@functools.cache
def _setting_error_type() -> type[config.ConfigError]:
    """ember.ConfigError as Dynamo's ShortenTraceback too. Dynamo wraps any other exception a
    backend raises in BackendCompilerFailed, under some 27 lines of its own frames; a
    ShortenTraceback it re-raises as it is, its traceback cut to the frame that raised it, so a
    setting error reads as the one line that names it."""
    try:
        from torch._dynamo.exc import ShortenTraceback
    except ImportError:  # pragma: no cover - in every torch ember supports
        return config.ConfigError

    class ConfigError(config.ConfigError, ShortenTraceback):
        def __init__(self, message: str, raised_in) -> None:
            ShortenTraceback.__init__(self, message, first_useful_frame=raised_in)

    ConfigError.__module__, ConfigError.__qualname__ = "ember", "ConfigError"
    return ConfigError


def ember_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    try:
        options = _checked_options(mode, options)
    except config.ConfigError as e:
        error_type = _setting_error_type()
        if error_type is config.ConfigError:
            raise
        raise error_type(str(e), sys._getframe()) from None
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with config.override(**options):
        _start_compile_workers(gm, example_inputs)
        if config.get("patterns"):
            # Before AOTAutograd, so that it traces SDPA's own backward (frontend/patterns.py).
            from ember.frontend.patterns import attention_pass

            attention_pass(gm)
        from ember.frontend.masked_attention import masked_attention_pass

        unmasked = masked_attention_pass(gm, example_inputs)

    from ember.frontend.decompositions import decomposition_table

    with config.override(**options):
        recompute = config.get("recompute")
        cached = _aot_cache_usable(gm)
    partition = {"partition_fn": min_cut_rematerialization_partition} if recompute else {}
    fell_back: list[str] = []
    compiler = aot_autograd(
        fw_compiler=_compiler("forward", options, cached, fell_back),
        bw_compiler=_compiler("backward", options, cached, fell_back),
        inference_compiler=_compiler("inference", options, cached, fell_back),
        decompositions=decomposition_table(),
        # Input mutations (batch norm's running statistics) stay in the graph as copy_ into the
        # input, which ember writes from the kernel computing the new value (importer: mutations).
        # Without it AOTAutograd copies each one after the graph: ResNet-50's training step made
        # 159 extra copy launches.
        keep_inference_input_mutations=True,
        # The min-cut partitioner saves fewer, smaller tensors and has the backward recompute cheap
        # pointwise work from them (which ember fuses into the backward's kernels): less memory
        # written and read, and a lower peak (the default saved every intermediate the backward
        # reads: hf_gpt2's training step peaked at 6.2 GB vs eager's 5.3 and Inductor's 4.2).
        **partition,
    )
    from ember.frontend.attention_backward import (
        eager_without_cudnn_attention,
        excludes_cudnn,
        training_attention_kernels,
    )

    as_written = unmasked if unmasked is not None else gm  # (masked SDPA calls stay SDPA if ember falls back)
    with config.override(**options):
        no_cudnn_attention = excludes_cudnn(as_written, example_inputs)
    # Dynamo's graph run eagerly in ember's place picks the kernels its trace would have.
    eager = eager_without_cudnn_attention(as_written.forward) if no_cudnn_attention else as_written.forward
    try:
        with (
            config.override(**options),
            progress.compiling(lambda: _graph_name(gm)),
            explained(),
            training_attention_kernels(no_cudnn_attention),
        ):
            if not cached:
                compiled = compiler(gm, example_inputs)
            else:
                from ember.frontend import aot_cache

                with aot_cache.in_force(options):
                    compiled = compiler(gm, example_inputs)
        return _dynamo_graph_if_eager(eager, compiled, fell_back)
    except dynamo_control_flow():
        raise  # PyTorch's own control flow: a restart of the capture, a graph break (ember/signals.py)
    except Exception as e:
        with config.override(**options):
            if config.get("strict"):
                raise
        return _eager_after_trace_failure(gm, eager, e)


def _start_compile_workers(gm: torch.fx.GraphModule, example_inputs) -> None:
    """A CUDA graph starts the Triton compile workers now, so that they are ready for its kernels
    (backends/triton.py: start_compile_workers)."""
    from ember.pipeline import graph_device

    try:
        device = graph_device(gm, example_inputs)
        if device.type == "cuda":
            from ember.backends.triton import start_compile_workers

            start_compile_workers(device)
    except Exception as e:  # noqa: BLE001  (workers only save time: the graph compiles without them)
        log.artifact("cache", "compile workers", f"not started early: {type(e).__name__}: {e}")


def _dynamo_graph_if_eager(eager: Callable, compiled, fell_back: list[str]):
    """What runs: AOTAutograd's compiled function, or Dynamo's graph where ember runs the inference
    or forward graph eagerly (the pipeline has warned, once, and its report names the reason).

    AOTAutograd's graphs are functional and decomposed: an optimizer's `_foreach_mul_` over 50
    tensors is 50 `mul`s there, plus a `copy_` back into each input, where Dynamo's graph calls the
    one `_foreach_mul_` eager calls, so the ATen graph run op by op is the slower of the two.
    Dynamo's graph is what `backend="eager"` runs; it can still trail
    the uncompiled call where the program takes another path while compiled (torch.optim's steps
    do: their step counts are tensors then). A backward that falls back lazily, after this
    returned, runs its ATen graph: the forward that saved its inputs is compiled."""
    if not any(kind in ("inference", "forward") for kind in fell_back):
        return compiled
    return eager


def _graph_name(gm: torch.fx.GraphModule) -> str:
    """The graph as Dynamo's own logs name it, by compile id: "graph 0/1 (96 ops)"."""
    from torch._guards import CompileContext

    compile_id = CompileContext.current_compile_id()
    ops = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
    return f"graph {compile_id if compile_id is not None else '?'} ({ops} ops)"


def _aot_cache_usable(gm: torch.fx.GraphModule) -> bool:
    """Whether AOTAutograd's cache may keep this compile's graphs (frontend/aot_cache.py)."""
    from ember.runtime.schedule_cache import cacheable_settings

    if not config.get("aot_cache") or not cacheable_settings() or config.get("cudagraphs") or config.get("freezing"):
        # (A graph AOTAutograd's cache loads is rebuilt from its schedule, not through the compiler
        # that puts it under CUDA graphs or splits off its frozen prologue.)
        return False  # checked first: the module below imports part of Inductor
    try:
        from ember.frontend import aot_cache
    except ImportError:
        return False
    return aot_cache.usable(gm)


def _eager_after_trace_failure(gm: torch.fx.GraphModule, eager: Callable, error: Exception):
    """AOTAutograd itself could not trace the graph (a PyTorch meta function raising: the backward
    of `_efficient_attention_forward` on torch 2.11): the Dynamo graph runs eagerly, loudly, and
    the report says so. ember's own passes never ran, so this is not one of its fail-safe catches."""
    from ember.report import GraphReport, publish

    report = GraphReport(kind="forward", num_nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"))
    report.fallback = f"AOTAutograd: {type(error).__name__}: {error}".strip()[:500]
    log.warn(f"ember: running a graph eagerly: {report.fallback}")
    publish(report)
    return eager


_register_lock = threading.Lock()


def register() -> str:
    """Make `backend="ember"` resolve, once, from any number of threads at a time: through pip's
    entry point where ember is installed, else (a checkout on PYTHONPATH, as on the GPU machine)
    by registering the function itself.

    torch's registry looks a name up and registers it in two unlocked steps, so threads whose
    first `torch.compile(backend="ember")` runs at the same moment can each load the entry point
    and all but one fail with "duplicate name: ember". A program that compiles from several
    threads calls this once first; calls to it are serialized here."""
    from torch._dynamo.backends import registry
    from torch._dynamo.exc import InvalidBackend

    with _register_lock:
        try:
            registry.lookup_backend("ember")  # registered already, or now, through pip's entry point
        except InvalidBackend:
            registry.register_backend(ember_backend, name="ember")
        except AssertionError:
            # "duplicate name": a torch.compile in another thread loaded the entry point at the same
            # time and registered the name first; it resolves now.
            registry.lookup_backend("ember")
    return "ember"
