"""The Backend protocol: what the pipeline and the host program ask of a code generator.

A backend is made for one device (pipeline.select_backend). It says what it is once, as a
frozen Target (ember/target.py) that the pipeline hands to the passes; it renders and builds a
schedule's kernels into callables; and it writes each kernel's launch into the host program
(codegen/host.py). Both backends.cpp.CppBackend and backends.triton.TritonBackend implement it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ember.schedule.gemm import GemmChooser
    from ember.schedule.kernel import Kernel
    from ember.schedule.memory import MemoryPlan
    from ember.target import Target


@runtime_checkable
class Backend(Protocol):
    name: str  # for reports: "triton", "cpp"
    # The template-or-ATen choice per matrix product (schedule/gemm.py); None: every product is
    # an ATen call.
    gemm_chooser: GemmChooser | None
    sources: dict[str, str]  # each built kernel's source, by kernel name
    full_source: str  # the whole generated module of the last build ("" before one)

    def target(self) -> Target:
        """What the device and this code generator can do: read once per graph by the pipeline."""
        ...

    def build(self, kernels: list[Kernel], memory: MemoryPlan) -> dict[str, object]:
        """Render and compile `kernels`; the host program's namespace entries (the callables).
        `memory`: the schedule's memory plan (which buffers of a kernel share memory)."""
        ...

    def prologue(self) -> list[str]:
        """Host-program lines run once per call before the first launch."""
        ...

    def launch_line(self, kernel: Kernel, args: dict) -> str:
        """The host-program line that launches `kernel`; `args["buffers"]` names its buffers in
        order, `args["maybe_unaligned"]` those the program did not allocate itself, `args["same"]` per
        buffer the first of its names bound to the same tensor (codegen/host.py)."""
        ...
