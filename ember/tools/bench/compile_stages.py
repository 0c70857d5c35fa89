"""Where a first step's time goes: Dynamo, AOTAutograd, the compiler's own stages, the first run.

Read in the child process of compile_time.py after its first step, from what each part records:

- Dynamo and AOTAutograd: PyTorch's own timers (`torch._dynamo.utils.compilation_time_metrics`,
  the `dynamo_timed` regions behind `compile_times()`): a frame's whole compile
  (`_compile.compile_inner`), the backend's part of it (`OutputGraph.call_user_compiler`), and a
  backward compiled lazily at its first call (`backward._backward_impl`). Dynamo is the frame's
  compile less the backend's part; AOTAutograd is the backend's part and the lazy backward less
  the compiler's own time (for ember this includes its entry's own work: options, the attention
  rewrite, AOTAutograd's cache lookups).
- ember: each pipeline stage summed over the graphs (`GraphReport.stage_seconds`), the build's
  parts (ember/stats.py: `build_*_s`, wall time), and Triton's stages as its compilation listener
  reports them (`triton_*_s`: CPU seconds summed over threads and compile workers, so they may
  exceed the build's wall time; `triton_cubin_s` is ptxas).
- Inductor: its `dynamo_timed` regions (nested, so they do not add up): lowering, code generation
  (scheduling and rendering), C++ builds, waiting for its parallel Triton compiles, module loads.
- The first run: the first step less every compile above (launches, and on the first call the
  loading of whatever the compile left lazy).
"""

from __future__ import annotations

# Inductor's regions reported, under a reader's name.
INDUCTOR_REGIONS = {
    "compile_fx_inner": "inductor (all)",
    "GraphLowering.run": "inductor: lowering",
    "GraphLowering.codegen": "inductor: scheduling + codegen",
    "compile_file": "inductor: C++ builds",
    "async_compile.wait": "inductor: waiting for Triton compiles",
    "PyCodeCache.load_by_key_path": "inductor: module loads",
}
# ember's counters (ember/stats.py) reported, under a reader's name.
EMBER_COUNTERS = {
    "build_render_s": "ember build: render",
    "build_module_file_s": "ember build: module file",
    "build_gemm_compile_s": "ember build: GEMM templates",
    "build_kernel_load_s": "ember build: kernels from launch records",
    "build_compile_s": "ember build: kernel keys + Triton compile (wall)",
    "triton_front_end_s": "triton: front end (cpu)",
    "triton_ttir_s": "triton: ttir (cpu)",
    "triton_ttgir_s": "triton: ttgir (cpu)",
    "triton_llir_s": "triton: llir (cpu)",
    "triton_ptx_s": "triton: ptx (cpu)",
    "triton_cubin_s": "triton: ptxas (cpu)",
}


def _total(metrics: dict, name: str) -> float:
    return float(sum(metrics.get(name, ())))


def breakdown(first_step_s: float, metrics: dict, ember_stages: dict, counters: dict, compiler: str) -> dict:
    """{stage: seconds} of one first step, in the order a reader follows it (see the module's docstring).
    `metrics`: PyTorch's compilation_time_metrics ({region: [seconds, ...]}); `ember_stages`: the
    summed GraphReport stages; `counters`: ember.stats' delta over the step."""
    frame = _total(metrics, "_compile.compile_inner")
    backend = _total(metrics, "OutputGraph.call_user_compiler")
    lazy_backward = _total(metrics, "backward._backward_impl")
    if compiler.startswith("ember"):
        own = sum(ember_stages.values())
    elif compiler.startswith("inductor"):
        own = _total(metrics, "compile_fx_inner")
    else:
        own = 0.0
    out = {
        "dynamo": max(0.0, frame - backend),
        "aot_autograd": max(0.0, backend + lazy_backward - own),
        "compiler": own,
    }
    if compiler.startswith("ember"):
        out.update({f"ember: {name}": s for name, s in ember_stages.items()})
        out.update({label: counters[key] for key, label in EMBER_COUNTERS.items() if counters.get(key)})
        for key in ("kernels_compiled", "kernel_dedup_hits", "kernel_dedup_disk_hits", "kernel_modules_imported"):
            if counters.get(key):
                out[f"count: {key}"] = counters[key]
    elif compiler.startswith("inductor"):
        out.update({label: _total(metrics, key) for key, label in INDUCTOR_REGIONS.items() if key in metrics})
    out["first run"] = max(0.0, first_step_s - frame - lazy_backward)
    return out


def stage_table(records: list[dict]) -> str:
    """A markdown table: one row per case, compiler and phase (cold, warm, imported), the top-level
    parts of its first step; and under it each row's detailed stages."""
    header = "| case | compiler | phase | to first result s | start-up s | Dynamo s | AOTAutograd s | compiler s | first run s |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    details = []
    for r in records:
        if r.get("type") != "compile" or "compilers" not in r:
            continue
        for comp, phases in r["compilers"].items():
            for phase, m in phases.items():
                if not isinstance(m, dict):
                    continue
                if "seconds" not in m:
                    lines.append(f"| {r['case']} | {comp} | {phase} | {m.get('error', 'err')} | | | | | |")
                    continue
                b = m.get("breakdown", {})
                cells = [m["seconds"], m.get("startup_s", 0.0)] + [
                    b.get(k, 0.0) for k in ("dynamo", "aot_autograd", "compiler", "first run")
                ]
                lines.append(f"| {r['case']} | {comp} | {phase} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
                rest = {k: v for k, v in b.items() if k not in ("dynamo", "aot_autograd", "compiler", "first run")}
                if rest:
                    shown = ", ".join(
                        f"{k} {v:.2f}" if not k.startswith("count") else f"{k} {v:.0f}" for k, v in rest.items()
                    )
                    details.append(f"- {r['case']} {comp} {phase}: {shown}")
    return "\n".join(lines + ([""] + details if details else [])) + "\n"
