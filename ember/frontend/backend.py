"""The torch.compile backend: `torch.compile(model, backend="ember")`.

Registered through the `torch_dynamo_backends` entry point (pyproject.toml), so Dynamo finds
it without `import ember`. Dynamo hands us a Torch-level FX graph; AOTAutograd, with ember's
decomposition table, turns it into functional ATen graphs (inference, or forward and
backward), and each one goes through ember's pipeline.
"""

from __future__ import annotations

from typing import Any

import torch

from ember import config

# torch.compile's modes are accepted so code written for Inductor runs unchanged; ember has
# no autotuning or CUDA graphs yet, so they all compile the same way.
KNOWN_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def _compiler(kind: str, options: dict[str, Any], cached: bool):
    """The compiler of one graph kind; `cached`: one whose results AOTAutograd's cache may keep
    (frontend/aot_cache.py)."""

    def compile_one(gm: torch.fx.GraphModule, example_inputs):
        from ember.pipeline import compile_graph

        # The backward graph is compiled lazily, after torch.compile returned: re-enter the
        # caller's options here so they apply to it too.
        with config.override(**options):
            program = compile_graph(gm, example_inputs, kind, keep_schedule=cached)
        if not cached:
            return program
        from ember.frontend import aot_cache

        return aot_cache.wrap(program, gm, kind, options)

    if not cached:
        return compile_one
    from ember.frontend import aot_cache

    return aot_cache.serializable(compile_one)


def ember_backend(gm: torch.fx.GraphModule, example_inputs, mode: str | None = None, options: dict | None = None):
    if mode not in KNOWN_MODES:
        raise config.ConfigError(f"unknown mode {mode!r}; valid: {', '.join(m for m in KNOWN_MODES if m)}")
    options = config.validate(dict(options or {}), "torch.compile options")
    config.check_environment()
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    with config.override(**options):
        if config.get("patterns"):
            # Before AOTAutograd, so that it traces SDPA's own backward (frontend/patterns.py).
            from ember.frontend.patterns import attention_pass

            attention_pass(gm)

    from ember.frontend.decompositions import decomposition_table

    with config.override(**options):
        recompute = config.get("recompute")
        cached = _aot_cache_usable(gm)
    partition = {"partition_fn": min_cut_rematerialization_partition} if recompute else {}
    compiler = aot_autograd(
        fw_compiler=_compiler("forward", options, cached),
        bw_compiler=_compiler("backward", options, cached),
        inference_compiler=_compiler("inference", options, cached),
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
    try:
        if not cached:
            return compiler(gm, example_inputs)
        from ember.frontend import aot_cache

        with aot_cache.in_force(options):
            return compiler(gm, example_inputs)
    except _DYNAMO_HANDLES:
        raise  # data-dependent ops: Dynamo breaks the graph there and compiles the pieces
    except Exception as e:
        with config.override(**options):
            if config.get("strict"):
                raise
        return _eager_after_trace_failure(gm, e)


def _aot_cache_usable(gm: torch.fx.GraphModule) -> bool:
    """Whether AOTAutograd's cache may keep this compile's graphs (frontend/aot_cache.py)."""
    from ember.runtime.schedule_cache import cacheable_settings

    if not config.get("aot_cache") or not cacheable_settings():
        return False  # checked first: the module below imports part of Inductor
    try:
        from ember.frontend import aot_cache
    except ImportError:
        return False
    return aot_cache.usable(gm)


def _dynamo_handles() -> tuple:
    from torch._subclasses import fake_tensor

    names = ("DataDependentOutputException", "DynamicOutputShapeException", "UnsupportedOperatorException")
    return tuple(getattr(fake_tensor, n) for n in names if hasattr(fake_tensor, n))


_DYNAMO_HANDLES = _dynamo_handles()


def _eager_after_trace_failure(gm: torch.fx.GraphModule, error: Exception):
    """AOTAutograd itself could not trace the graph (a PyTorch meta function raising: the backward
    of `_efficient_attention_forward` on torch 2.11): the Dynamo graph runs eagerly, loudly, and
    the report says so. ember's own passes never ran, so this is not one of its fail-safe catches."""
    import warnings

    from ember.report import GraphReport, publish

    report = GraphReport(kind="forward", num_nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"))
    report.fallback = f"AOTAutograd: {type(error).__name__}: {error}".strip()[:500]
    warnings.warn(f"ember: running a graph eagerly: {report.fallback}", stacklevel=2)
    publish(report)
    return gm.forward


def register() -> str:
    """Make `backend="ember"` resolve when ember is on the path but not installed (a checkout on
    PYTHONPATH, as on the GPU machine): pip's entry point is what normally registers the name."""
    from torch._dynamo.backends import registry

    if "ember" not in registry.list_backends(exclude_tags=()):
        registry.register_backend(ember_backend, name="ember")
    return "ember"
