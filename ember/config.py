"""ember's one settings registry.

Every setting has a name, a type, a default, a help string and an environment variable
(`EMBER_<NAME>`). Values come, in increasing priority, from the default, the environment,
and scoped overrides (`with config.override(debug=2): ...`, or `options={...}` given to
`torch.compile`). Unknown names and bad values are errors that list what is valid.

Settings marked `codegen=True` change what ember generates for a program (the graphs AOTAutograd
hands it, their schedules, kernels or binaries), so they enter cache keys (runtime/cache.py); the
others only change what is reported, whether and where things are cached, and how fast.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ember.fault_points import parse_faults
from ember.setting import ConfigError, Setting


def _default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "ember")


# Named log artifacts (log.py prints them); validated when EMBER_LOGS is parsed.
LOG_ARTIFACTS = ("graph", "fusion", "schedule", "code", "cache", "patterns", "cudagraphs", "asm", "recompiles")


def _valid_artifacts(value: str) -> bool:
    return all(name.strip() in LOG_ARTIFACTS for name in value.split(",") if name.strip())


def _valid_faults(value: str) -> bool:
    """Whether `value` names fault points and their arguments (a ValueError says which does not)."""
    parse_faults(value)
    return True


def _valid_heuristics(value: str) -> bool:
    """Whether `value` names heuristics of ember/target.py and values they take (a ValueError
    says which part does not)."""
    from ember.target import Heuristics

    Heuristics().tuned(value)
    return True


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("strict", bool, False, "raise instead of falling back to eager when ember fails on a graph"),
        Setting(
            "debug",
            int,
            0,
            "0 quiet; 1 one line per graph; 2 also generated source; 3 also IR after each pass; "
            "4 also each kernel's machine code (assembly on the CPU, PTX and SASS on the GPU)",
            check=lambda v: 0 <= v <= 4,
        ),
        Setting(
            "logs",
            str,
            "",
            f"comma-separated artifacts to log, from: {', '.join(LOG_ARTIFACTS)}",
            check=_valid_artifacts,
        ),
        Setting(
            "progress",
            str,
            "auto",
            "report a long compile's graph, stage and kernel count on stderr once it has run "
            "progress_after_s: auto (when stderr is a terminal), on, off",
            choices=("auto", "on", "off"),
        ),
        Setting(
            "progress_after_s",
            float,
            2.0,
            "seconds a compile runs before it reports progress (a quicker one prints nothing)",
            check=lambda v: v >= 0,
        ),
        Setting("check", bool, False, "run the IR verifier after each pass"),
        Setting(
            "fault_inject",
            str,
            "",
            "testing aid: faults to raise at named points of ember (ember/fault_points.py, ember/faults.py), comma-separated "
            "point or point=argument",
            check=_valid_faults,
        ),
        Setting(
            "backend",
            str,
            "auto",
            "code generator: auto (triton on cuda, cpp on cpu), triton, cpp",
            choices=("auto", "triton", "cpp"),
            codegen=True,
        ),
        Setting("cache", bool, True, "use the on-disk cache of generated source and binaries"),
        Setting("cache_dir", str, _default_cache_dir(), "where the disk cache lives"),
        Setting(
            "cache_max_mb",
            int,
            1024,
            "largest size of the disk cache in MiB: past it, the least recently used entries are removed (0: no bound)",
            check=lambda v: v >= 0,
        ),
        Setting("cxx", str, "g++", "C++ compiler for the cpp backend", codegen=True),
        Setting(
            "cpp_precompiled_header",
            bool,
            True,
            "build C++ kernels on a precompiled header of their standard headers, made once per compiler, "
            "flags and CPU and kept in the disk cache (GCC only; the same libraries, built faster)",
        ),
        Setting(
            "persistent_reduction_max",
            int,
            16384,
            "largest reduction (elements per row) that one Triton program holds in registers at once",
            check=lambda v: v >= 1,
            codegen=True,
        ),
        Setting(
            "column_partial_programs",
            int,
            0,
            "programs of a Triton row kernel that also sums its rows' columns (a LayerNorm backward's "
            "weight gradients); the column sums are split into one to two times that many chunks. 0: one per SM; "
            "-1: never (column sums get kernels of their own)",
            check=lambda v: v >= -1,
            codegen=True,
        ),
        Setting(
            "heuristics",
            str,
            "",
            "changes to the target's heuristics, for sweeps: comma-separated group.field=value, e.g. "
            "split.max_second_split=8,launch.column_one_sum=64x8x4 (ember/target.py lists them)",
            check=_valid_heuristics,
            codegen=True,
        ),
        Setting(
            "max_kernel_buffers",
            int,
            48,
            "most distinct buffers one fused kernel may read and write (more: refuse the merge; "
            "kernels with huge argument lists compile slowly and spill)",
            check=lambda v: v >= 2,
            codegen=True,
        ),
        Setting(
            "fuse",
            bool,
            True,
            "merge kernels (off: one kernel per realized value, for debugging)",
            codegen=True,
        ),
        Setting(
            "indexed_stores",
            bool,
            True,
            "on the GPU, a write into rows of a graph input (a static KV cache's index_copy_ or index_put_) is "
            "stored by the kernel computing the rows, where it can only be in place (off: ATen's in-place call)",
            codegen=True,
        ),
        Setting(
            "gathers",
            bool,
            True,
            "index_select, embedding, x[i, j] and torch.gather are computed in the kernels reading them (off: ATen's)",
            codegen=True,
        ),
        Setting(
            "scatter_adds",
            bool,
            True,
            "on the GPU, scatter_add, index_add and index_put(accumulate) add atomically in a kernel (off: ATen's)",
            codegen=True,
        ),
        Setting(
            "overlap_collectives",
            bool,
            True,
            "order a graph's functional collectives so compute overlaps them: each starts as soon as its inputs "
            "allow, each wait just before its result is first read (off: the graph's order)",
            codegen=True,
        ),
        Setting(
            "fusion_rank_every_pair",
            bool,
            False,
            "after each merge, rank every candidate pair of kernels again, not only those near the merge "
            "(slow: a check that both choose the same merges)",
            codegen=True,
        ),
        Setting(
            "recompute",
            bool,
            True,
            "training: let AOTAutograd's min-cut partitioner (Inductor's) choose what the forward saves "
            "and what the backward recomputes from fewer saved tensors (off: its default partitioner, "
            "which saves every intermediate the backward reads)",
            codegen=True,
        ),
        Setting(
            "freezing",
            bool,
            False,
            "inference graphs (no grad): the parameters and buffers AOTAutograd marks static become constants: "
            "batch norm (any per-channel scale and shift) after a convolution or linear layer is folded into its "
            "weight and bias (or, where pointwise ops read the result, into one multiply-add by per-channel "
            "vectors), and computations over them alone run once, at the first call; a replaced or "
            "in-place-modified parameter is seen at the next call, which computes them again",
            codegen=True,
        ),
        Setting(
            "prepack",
            bool,
            True,
            "under freezing, CPU float32 2-d convolutions and linear layers run on weights packed once into "
            "oneDNN's blocked layout (batch norm folded in), convolutions with their ReLU, ReLU6, SiLU or sigmoid "
            "fused: a second copy of those weights beside the model's own (off: plain weights, read as they are)",
            codegen=True,
        ),
        Setting(
            "channels_last",
            bool,
            True,
            "inference graphs' 2-d convolutions of static sizes, on the CPU or in half precision on a GPU, read "
            "channels-last inputs (weights too: on a GPU per call, by autocast's cast where there is one; under "
            "freezing once), and the kernels between them that layout; outputs keep eager's strides. Not where "
            "the k x k weights to convert per call outnumber the convolutions' inputs (ResNet-18 on the CPU), "
            "unless freezing packs them (prepack)",
            codegen=True,
        ),
        Setting(
            "patterns",
            bool,
            True,
            "rewrite attention written out by hand (matmul, scale, mask, softmax, matmul) to "
            "scaled_dot_product_attention before AOTAutograd (EMBER_LOGS=patterns lists each rewrite)",
            codegen=True,
        ),
        Setting(
            "bisect_ops",
            int,
            -1,
            "lower only the first N ATen ops of each graph, run later ones as ATen calls (-1: all; set by ember bisect)",
            check=lambda v: v >= -1,
            codegen=True,
        ),
        Setting(
            "direct_launch",
            bool,
            True,
            "launch compiled Triton kernels through their launcher directly (off: through "
            "kernel[grid](...), which re-binds and re-specializes the arguments on every call; "
            "turn off to let Triton's launch hooks, e.g. its profiler, see each launch)",
        ),
        Setting(
            "fp_contract",
            bool,
            True,
            "let Triton contract a*b + c into one FMA (as nvcc does for eager's kernels); off: a "
            "product computed in two places rounds the same in both (layer norm's backward over "
            "one-element rows then gives exactly 0, as eager), at up to 5% on compute-heavy rows "
            "(cross_entropy over 50257 classes, H100)",
            codegen=True,
        ),
        Setting(
            "sdpa_cudnn_training",
            bool,
            False,
            "let AOTAutograd trace SDPA in CUDA graphs that need gradients into cuDNN's attention kernel; off: "
            "torch 2.11 caches cuDNN's backward plans without the output gradient's strides and silently "
            "miscomputes a gradient laid out otherwise than at the plan's first call (frontend/attention_backward.py)",
            codegen=True,
        ),
        Setting(
            "sdpa_masked_flex",
            bool,
            True,
            "in CUDA (Triton) graphs that need gradients, SDPA with a mask tensor runs as ember's FlexAttention "
            "kernels with a BlockMask computed from the mask (blocks it removes skipped); off: SDPA's "
            "memory-efficient kernel (frontend/masked_attention.py)",
            codegen=True,
        ),
        Setting(
            "flex_atomic_dq",
            bool,
            True,
            "FlexAttention's GPU backward for float32 inputs adds dq up atomically in its dk/dv kernel (five "
            "products per step instead of seven); never under deterministic algorithms (codegen/flex_triton_bwd.py)",
            codegen=True,
        ),
        Setting(
            "sdpa_causal_flex",
            bool,
            True,
            "in CUDA (Triton) graphs that need gradients, causal SDPA without a mask in 16-bit dtypes runs as ember's "
            "FlexAttention kernels over a causal BlockMask, faster than flash attention in training "
            "(frontend/masked_attention.py)",
            codegen=True,
        ),
        Setting(
            "gemm",
            str,
            "aten",
            "GPU matrix products (mm, addmm, bmm): aten (cuBLAS, the epilogue a following fused "
            "kernel; the default: the template loses to cuBLAS on the H100, see docs/architecture.md), "
            "auto (measure ember's Triton GEMM template against ATen on the GPU once per shape class, "
            "cached on disk), template. The C++ target's products take its own template within its "
            "Target's bounds (heuristics cpp.gemm_template, cpp.gemm_max_k, cpp.gemm_max_a_bytes)",
            choices=("auto", "aten", "template"),
            codegen=True,
        ),
        Setting(
            "autotune",
            bool,
            False,
            "measure each static Triton kernel's launch configurations (blocks, warps, loop stages: the "
            "heuristic's and its neighbours, target.heuristics.tune) on first use and keep the fastest, "
            "cached on disk by device, SM count and kernel source (mode='max-autotune' turns it on, with gemm=auto)",
            codegen=True,
        ),
        Setting(
            "autotune_budget",
            float,
            0.1,
            "fraction of a graph's own compile time so far (tuning excluded) that tuning its kernels and "
            "GEMM shapes may add (results read from the disk cache cost nothing; the kernels moving the most "
            "bytes are tuned first)",
            check=lambda v: v >= 0,
        ),
        Setting(
            "autotune_min_s",
            float,
            0.5,
            "seconds that tuning a graph's kernels may take at least, whatever autotune_budget allows",
            check=lambda v: v >= 0,
        ),
        Setting(
            "autotune_timer",
            str,
            "auto",
            "how candidates are timed: cuda (CUDA events, L2 flushed before each run, the median), wall "
            "(the host's clock, for Triton's CPU interpreter), auto (cuda on a GPU, else wall)",
            choices=("auto", "cuda", "wall"),
        ),
        Setting(
            "compile_threads",
            int,
            min(8, os.cpu_count() or 1),
            "threads used to compile a graph's Triton kernels in parallel",
            check=lambda v: v >= 1,
        ),
        Setting(
            "compile_workers",
            int,
            min(15, (os.cpu_count() or 1) - 1),
            "worker processes that compile Triton kernels ahead of the threads (0: threads only); "
            "started once per process, for graphs of at least 16 kernels; one core is left to the caller",
            check=lambda v: v >= 0,
        ),
        Setting(
            "compile_workers_early",
            bool,
            False,
            "start the compile workers when the first CUDA graph arrives instead of at the first build of "
            "16 kernels or more (off: their start slowed AOTAutograd's tracing of training graphs by more "
            "than it saved)",
        ),
        Setting(
            "schedule_cache",
            bool,
            True,
            "reuse a graph's schedule from the disk cache when the same ATen graph, input layouts, "
            "settings and ember source were scheduled before (skips import through scheduling)",
        ),
        Setting(
            "aot_cache",
            bool,
            True,
            "let AOTAutograd's cache keep ember's compiled graphs, so that a warm start also skips "
            "AOTAutograd's tracing and partitioning (only where schedule_cache applies)",
        ),
        Setting(
            "cudagraphs",
            bool,
            False,
            "record each compiled GPU graph into a CUDA graph and replay it (mode='reduce-overhead' and "
            "'max-autotune' turn it on; docs/cudagraphs.md: static inputs, steps, held outputs)",
        ),
        Setting(
            "cudagraphs_max_graphs",
            int,
            8,
            "most CUDA graphs recorded for one compiled graph (new shapes, or parameters at new addresses); "
            "past it the graph runs without CUDA graphs, with one warning",
            check=lambda v: v >= 1,
        ),
        Setting(
            "cudagraphs_default",
            bool,
            True,
            "without cudagraphs, still record the GPU graphs that can be captured, returning fresh copies of what "
            "the caller keeps; a recording is kept only where it pays (docs/cudagraphs.md, 'the default mode')",
        ),
        Setting(
            "cudagraphs_expandable_pool",
            bool,
            True,
            "capture CUDA graphs with the allocator's expandable segments on, so the graph pool grows as one "
            "mapped range whose freed blocks merge (docs/cudagraphs.md, 'what the pool costs in memory')",
        ),
        Setting(
            "profile_ranges",
            bool,
            False,
            "the host program wraps each kernel launch in a torch.profiler range named after the kernel, so "
            "a profile shows ember's own kernels one by one (on the CPU, where they are otherwise one "
            "'Torch-Compiled Region'; on a GPU, each launch's host time); costs a few microseconds a kernel",
            codegen=True,
        ),
        Setting(
            "cpu_huge_pages",
            bool,
            True,
            "advise CPU buffers of 32 MiB or more to use transparent huge pages before their first "
            "write (one page fault per 2 MiB, not per 4 KiB; only where the kernel's THP mode is madvise)",
        ),
        Setting(
            "constant_fold",
            bool,
            True,
            "values a graph computes from constants alone (FlexAttention's BlockMask built in the graph when "
            "none is given) are computed once at compile time and read as constants (frontend/constant_fold.py)",
            codegen=True,
        ),
        Setting(
            "conv_bias_epilogue",
            bool,
            True,
            "a CUDA convolution's bias is added by the ember kernel that reads its result, not by ATen's "
            "own launch after cuDNN's, and its gradient is summed by an ember kernel, not by convolution_backward "
            "(frontend/conv_bias.py)",
            codegen=True,
        ),
        Setting(
            "cpu_heap_retain_mb",
            int,
            256,
            "once a CPU graph is compiled, glibc's malloc serves chunks below 32 MiB from its heap and keeps "
            "up to this many MiB of freed heap, so a call's buffers are not faulted in and zeroed anew by "
            "the kernel each call (runtime/heap.py); process-wide; 0 leaves malloc as it is",
        ),
    ]
}

_local = threading.local()


def _overrides() -> list[dict[str, Any]]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def _did_you_mean(word: str, candidates) -> str:
    """ "; did you mean 'x'?" for the closest candidate, or ""."""
    close = difflib.get_close_matches(word, list(candidates), n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _lookup(name: str, source: str | None = None) -> Setting:
    setting = SETTINGS.get(name)
    if setting is None:
        where = f"{source}: " if source else ""
        raise ConfigError(
            f"{where}unknown ember setting {name!r}{_did_you_mean(name, SETTINGS)} "
            f"(valid settings: {', '.join(sorted(SETTINGS))})"
        )
    return setting


def get(name: str) -> Any:
    """The current value of setting `name`: innermost override, else environment, else default."""
    setting = _lookup(name)
    for layer in reversed(_overrides()):
        if name in layer:
            return layer[name]
    raw = os.environ.get(setting.env_var)
    if raw is not None:
        return setting.parse(raw, f"environment variable {setting.env_var}")
    return setting.default


def validate(options: dict[str, Any], source: str = "options") -> dict[str, Any]:
    """Check names and convert values; returns a new dict of parsed values."""
    return {name: _lookup(name, source).parse(value, source) for name, value in options.items()}


@contextlib.contextmanager
def override(**options: Any) -> Iterator[None]:
    """Scoped settings: `with ember.config.override(strict=True): ...`."""
    stack = _overrides()
    stack.append(validate(options, "override"))
    try:
        yield
    finally:
        stack.pop()


def snapshot() -> dict[str, Any]:
    """All settings' current values (for reports and for carrying into worker threads)."""
    return {name: get(name) for name in SETTINGS}


def changed() -> dict[str, Any]:
    """The settings whose current value is not their default (an override or the environment), with it:
    what a measurement's record says it ran under."""
    return {name: value for name, value in snapshot().items() if value != SETTINGS[name].default}


def codegen_key() -> dict[str, Any]:
    """The settings marked `codegen`, with their values: the one list of settings that enter cache
    keys (runtime/cache.py: ember_identity)."""
    return {name: get(name) for name, s in SETTINGS.items() if s.codegen}


def unknown_environment() -> list[str]:
    """One line for each EMBER_* environment variable that names no setting (a misspelling, or a
    setting an older or newer ember had), with the closest valid name."""
    valid = [s.env_var for s in SETTINGS.values()]
    return [
        f"unknown environment variable {name}{_did_you_mean(name, valid)}"
        for name in sorted(os.environ)
        if name.startswith("EMBER_") and name not in valid
    ]


def check_environment() -> None:
    """Parse every EMBER_* variable so a bad value fails at compile start, not mid-way."""
    unknown = unknown_environment()
    if unknown:
        raise ConfigError(f"{unknown[0]} (valid: {', '.join(s.env_var for s in SETTINGS.values())})")
    for s in SETTINGS.values():
        if s.env_var in os.environ:
            s.parse(os.environ[s.env_var], f"environment variable {s.env_var}")


def describe() -> str:
    """A table of every setting, for `ember config`, then what is wrong in the environment."""
    lines, problems = [], unknown_environment()
    for s in SETTINGS.values():
        try:
            value = repr(get(s.name))
        except ConfigError as e:
            value = "(invalid)"
            problems.append(str(e))
        lines.append(f"{s.env_var:<32} {value:<12} {s.help}")
    return "\n".join(lines + [f"warning: {p}" for p in problems])
