"""The Target of the Triton backend (ember/target.py): a GPU's, read from the device, or that of Triton's
CPU interpreter, which schedules as a GPU of INTERPRETER_SM_COUNT SMs would."""

from __future__ import annotations

import torch

from ember import config
from ember.backends.device import device_limits
from ember.target import (
    INTERPRETER_SM_COUNT,
    Heuristics,
    HorizontalHeuristics,
    PadHeuristics,
    RealizeHeuristics,
    SkinnyHeuristics,
    SplitHeuristics,
    Target,
)


def gpu_arch(device: int | None = None) -> tuple:
    """Triton's target of GPU `device` (None: the current one): (backend, arch, warp size), what its binaries
    are built for.

    On NVIDIA GPUs it is what Triton's CUDA driver answers, computed from torch's compute capability
    without making the driver: that builds Triton's C helpers with the host compiler where Triton's
    cache lacks them (some 0.3 s of a first step on a fresh machine, and of an imported cache's start),
    though a start whose kernels all launch from their records needs nothing else of Triton's."""
    if torch.version.hip is None and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(torch.cuda.current_device() if device is None else device)
        return ("cuda", major * 10 + minor, 32)
    from triton.runtime import driver

    t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


# A GPU's split reductions aim for more partial results than the default: a bias gradient over
# 16384 rows is summed in 64 chunks of 256 rows when 768 wide, 16 of 1024 when 3072 wide: more
# programs in flight, each walking fewer rows, which a GPU runs side by side (decisions.md).
# cuBLAS runs fast only on aligned extents: products on the GPU get padded layouts.
_GPU_SPLIT = SplitHeuristics(partials=131072)
# Kernels of one body run as one table combo kernel however many (codegen/triton_combo.py).
_GPU_HORIZONTAL = HorizontalHeuristics(table_min_parts=2)


def _atomic_adds(arch: tuple) -> tuple:
    """The float dtypes Triton adds atomically on `arch`: bf16 from sm_90, where the GPU has a bf16 atomic
    add (the interpreter, arch (), has none)."""
    wide = (torch.float32, torch.float64, torch.float16)
    bf16 = bool(arch) and arch[0] == "cuda" and isinstance(arch[1], int) and arch[1] >= 90
    return (*wide, torch.bfloat16) if bf16 else wide


def make_target(device) -> Target:
    """The Target of `device` (None: the CPU, through the interpreter)."""
    device = device if device is not None else torch.device("cpu")
    limits = device_limits(device)
    gpu = device.type == "cuda"
    sm_count = limits.sm_count if gpu else INTERPRETER_SM_COUNT
    # Row kernels that also sum columns get one program per SM (column_partial_programs: another
    # count; -1 none): on the H100 a LayerNorm's forward and backward ran fastest so, against
    # half and twice as many.
    programs = config.get("column_partial_programs")
    arch = gpu_arch(device.index) if gpu else ()
    target = Target(
        "triton",
        device.type,
        limits.name,
        interpreting(),
        sm_count,
        arch,
        limits.bandwidth,
        limits.flop_rate,
        limits.launch_seconds,
        online_softmax=True,
        indexed_rows=True,
        row_stores=True,
        combo_rows=True,
        atomic_adds=_atomic_adds(arch),
        row_programs=max(0, programs) if programs else sm_count,
        heuristics=Heuristics(
            split=_GPU_SPLIT,
            pad=PadHeuristics(products=gpu),
            horizontal=_GPU_HORIZONTAL,
            realize=RealizeHeuristics(scalars_per_element=False),
            skinny=SkinnyHeuristics(max_rows=16),
        ),
    )
    return target.tuned(config.get("heuristics"))


def interpreting() -> bool:
    """Whether Triton's CPU interpreter runs the kernels (TRITON_INTERPRET, as Triton reads it):
    the one place ember asks. The Target carries the answer to every pass and renderer."""
    import triton

    return bool(triton.knobs.runtime.interpret)
