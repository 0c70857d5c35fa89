"""Each kernel's code at every layer below its source, and what the machine code uses.

C++ (CPU): the kernel's C++ and its x86 assembly, from `g++ -S` with the flags the library was built with
(OpenMP's outlined loop bodies, `fk3._omp_fn.0`, belong to their kernel). Triton (GPU): the kernel's
Triton source, then the stages Triton keeps in its compiled kernel (TTIR, TTGIR, LLVM IR, PTX) and the
SASS of its cubin (`cuobjdump -sass`, else `nvdisasm`), with registers, spills, shared memory, warps and
the occupancy they allow. Under Triton's interpreter nothing is compiled: only the source is shown.

Made on demand (`ember.explain`, `EMBER_DEBUG=4`): the compiled kernels are looked up (Triton's
in-memory cache) or the assembly recompiled, never on a normal compile.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The layers each backend can show, in order from the source down.
CPU_LAYERS = ("C++", "x86 assembly")
GPU_LAYERS = ("Triton", "TTIR", "TTGIR", "LLVM IR", "PTX", "SASS")
_TRITON_ASM = {"TTIR": "ttir", "TTGIR": "ttgir", "LLVM IR": "llir", "PTX": "ptx"}
MACHINE_LAYERS = ("x86 assembly", "PTX", "SASS")


@dataclass
class KernelLayers:
    name: str
    layers: dict[str, str] = field(default_factory=dict)  # layer -> its text, from the source down
    # What the machine code uses: registers, spills, shared memory, warps, occupancy (GPU);
    # instructions and vector width (CPU).
    resources: dict[str, Any] = field(default_factory=dict)
    missing: dict[str, str] = field(default_factory=dict)  # layer -> why it is not shown
    # The device function its launches run, as a profiler names them: Triton kernels equal up to names
    # share the first one's binary (backends/kernel_dedup.py), so two kernels may run one symbol.
    symbol: str = ""

    def describe_resources(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in self.resources.items())


def kernel_layers(backend, kernels: list) -> dict[str, KernelLayers]:
    """Each kernel's layers (by name), for a backend that has built `kernels`."""
    from ember.backends.cpp import CppBackend

    if isinstance(backend, CppBackend):
        return cpp_layers(backend, kernels)
    return triton_layers(backend, kernels)


def format_layers(layers: dict[str, KernelLayers], machine_only: bool = False) -> str:
    """The layers as text: every one, or (`machine_only`, EMBER_DEBUG=4) the machine code's alone."""
    parts = []
    for kl in layers.values():
        parts.append(f"--- {kl.name}: {kl.describe_resources() or 'no resource figures'} ---")
        for layer, text in kl.layers.items():
            if not machine_only or layer in MACHINE_LAYERS:
                parts.append(f"### {kl.name} {layer}\n{text.rstrip()}")
        parts += [f"### {kl.name} {layer}: not available ({why})" for layer, why in kl.missing.items()]
    return "\n".join(parts)


# -- C++ -------------------------------------------------------------------------------------------


def cpp_layers(backend, kernels: list) -> dict[str, KernelLayers]:
    from ember.backends.cpp import FLAGS

    out = {k.name: KernelLayers(k.name, {"C++": backend.sources.get(k.name, "")}, symbol=k.name) for k in kernels}
    if not kernels:
        return out
    flags = [f for f in FLAGS if f not in ("-shared",)]
    try:
        with tempfile.TemporaryDirectory(prefix="ember-asm-") as tmp:
            src = Path(tmp) / "graph.cpp"
            src.write_text(backend.full_source)
            cmd = [backend.cxx, *flags, "-S", str(src), "-o", str(Path(tmp) / "graph.s")]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"{backend.cxx} -S exited {proc.returncode}: {proc.stderr.strip()[:500]}")
            functions = split_functions((Path(tmp) / "graph.s").read_text())
    except (OSError, subprocess.SubprocessError, RuntimeError) as e:
        for kl in out.values():
            kl.missing["x86 assembly"] = str(e)
        return out
    for name, kl in out.items():
        mine = {f: body for f, body in functions.items() if f == name or f.startswith(f"{name}._omp_fn.")}
        if not mine:
            kl.missing["x86 assembly"] = "no function of that name in the assembly"
            continue
        kl.layers["x86 assembly"] = "\n\n".join(mine.values())
        kl.resources.update(cpu_resources("\n".join(mine.values())))
    return out


def split_functions(assembly: str) -> dict[str, str]:
    """GCC's assembly split by function (`.type f, @function` ... `.size f`), directives that only
    describe unwinding or debugging left out."""
    functions: dict[str, str] = {}
    current: str | None = None
    body: list[str] = []
    for line in assembly.splitlines():
        stripped = line.strip()
        m = re.match(r"\.type\s+([^,]+),\s*@function", stripped)
        if m:
            current, body = m.group(1), []
            continue
        if current is None:
            continue
        if stripped.startswith((f".size\t{current},", f".size {current},")):
            functions[current] = "\n".join(body)
            current = None
            continue
        if stripped.startswith((".cfi_", ".p2align", ".loc", ".file")):
            continue
        body.append(line)
    return functions


def cpu_resources(assembly: str) -> dict[str, Any]:
    instructions = [
        line.strip() for line in assembly.splitlines() if line.startswith("\t") and not line.strip().startswith(".")
    ]
    width = "512-bit (zmm)" if "%zmm" in assembly else "256-bit (ymm)" if "%ymm" in assembly else "128-bit or scalar"
    return {"instructions": len(instructions), "vector width": width}


# -- Triton ----------------------------------------------------------------------------------------


def triton_layers(backend, kernels: list) -> dict[str, KernelLayers]:
    out = {k.name: KernelLayers(k.name, {"Triton": backend.sources.get(k.name, "")}) for k in kernels}
    for name, kl in out.items():
        static = getattr(backend, "static", {}).get(name)
        kl.symbol = static.record.get("name", name) if static is not None else name
    target = backend.target()
    if target.interpreted:
        for kl in out.values():
            for layer in GPU_LAYERS[1:]:
                kl.missing[layer] = "Triton's interpreter runs the source; nothing is compiled"
        return out
    try:
        compiled = _compiled_kernels(backend, [k.name for k in kernels])
    except Exception as e:  # noqa: BLE001 - a report shows why a layer is missing; the program still runs
        compiled = {}
        reason = f"{type(e).__name__}: {e}"[:300]
        for kl in out.values():
            kl.missing.update({layer: reason for layer in GPU_LAYERS[1:]})
    props = _device_properties(backend.device)
    for name, ck in compiled.items():
        kl = out[name]
        for layer, key in _TRITON_ASM.items():
            if key in ck.asm:
                kl.layers[layer] = ck.asm[key]
        sass, why = disassemble(ck.asm.get("cubin"))
        if sass:
            kl.layers["SASS"] = sass
        else:
            kl.missing["SASS"] = why
        kl.resources.update(gpu_resources(ck, props))
    return out


def _compiled_kernels(backend, names: list[str]) -> dict[str, Any]:
    """Triton's compiled kernel of each name: `warmup` with the arguments the build compiled for,
    which Triton's cache answers without compiling again."""
    from ember.backends import triton as tb

    module = backend._load(backend.full_source)
    fns = {n: getattr(module, n) for n in names if n in backend.rendered}
    jobs = tb._warmup_jobs(fns, backend.rendered)
    # Kernels that share another's binary were never compiled under their own name: compile them here,
    # in threads (Triton's stages and ptxas run outside the GIL).
    with ThreadPoolExecutor(max(1, min(8, len(jobs)))) as pool:
        futures = {job[0]: pool.submit(tb._warmup, *job[1:]) for job in jobs}
    compiled = {name: f.result() for name, f in futures.items()}
    for name, src in backend.gemm_kernels.items():
        warm = src.warmup_args() if name in names else None
        if warm is not None:
            args, consts = warm
            compiled[name] = getattr(module, name).warmup(*args, grid=(1,), **consts)
    return compiled


def _device_properties(device) -> dict[str, int]:
    import torch

    p = torch.cuda.get_device_properties(device)
    return {
        "regs_per_sm": getattr(p, "regs_per_multiprocessor", 65536),
        "threads_per_sm": getattr(p, "max_threads_per_multi_processor", 2048),
        "shared_per_sm": getattr(p, "shared_memory_per_multiprocessor", 228 * 1024),
        "blocks_per_sm": 32,
    }


def gpu_resources(ck, props: dict[str, int]) -> dict[str, Any]:
    init = getattr(ck, "_init_handles", None)
    if init is not None:
        init()  # loads the binary; sets n_regs and n_spills
    meta = ck.metadata
    warps = getattr(meta, "num_warps", 4)
    shared = getattr(meta, "shared", 0)
    regs = getattr(ck, "n_regs", None)
    res: dict[str, Any] = {"registers": regs, "spills": getattr(ck, "n_spills", None), "shared bytes": shared}
    res["warps"] = warps
    if regs is not None:
        blocks, frac = occupancy(regs, shared, warps, props)
        res["blocks/SM"] = blocks
        res["occupancy"] = f"{frac:.0%}"
    return res


def occupancy(regs: int, shared: int, warps: int, props: dict[str, int]) -> tuple[int, float]:
    """(resident blocks per SM, resident warps over the SM's most) for a kernel using `regs` registers
    per thread and `shared` bytes of shared memory per block of `warps` warps. Registers are given
    out per warp in units of 256, as on every NVIDIA GPU since Volta."""
    threads = warps * 32
    regs_per_warp = -(-max(regs, 1) * 32 // 256) * 256
    by_regs = props["regs_per_sm"] // (regs_per_warp * warps)
    by_threads = props["threads_per_sm"] // threads
    by_shared = props["shared_per_sm"] // shared if shared else props["blocks_per_sm"]
    blocks = max(0, min(by_regs, by_threads, by_shared, props["blocks_per_sm"]))
    return blocks, blocks * threads / props["threads_per_sm"]


def cuda_tool(name: str) -> str | None:
    """`cuobjdump` or `nvdisasm`: on the PATH, else the copy Triton ships."""
    found = shutil.which(name)
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(bundled) if bundled.exists() else None


def disassemble(cubin: bytes | None) -> tuple[str, str]:
    """(the SASS of a cubin, "") or ("", why not)."""
    if not cubin:
        return "", "the compiled kernel holds no cubin"
    with tempfile.TemporaryDirectory(prefix="ember-sass-") as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        for tool, args in (("cuobjdump", ["-sass"]), ("nvdisasm", ["-c"])):
            exe = cuda_tool(tool)
            if exe is None:
                continue
            try:
                proc = subprocess.run([exe, *args, str(path)], capture_output=True, text=True, timeout=120, check=False)
            except (OSError, subprocess.SubprocessError):
                continue
            if proc.returncode == 0 and proc.stdout.strip():
                return proc.stdout, ""
    return "", "neither cuobjdump nor nvdisasm is on the PATH or in Triton's package"
