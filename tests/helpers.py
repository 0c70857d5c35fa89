"""Shared helpers: compile with ember, compare with eager PyTorch, and print one-line repros."""

from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import torch

import ember
from ember.report import ExplainReport, collecting
from ember.tools.workloads import WORKLOADS, GPT2Stack

# Which workload scale each code generator is tested at: Triton runs in its (slow) CPU
# interpreter, so it gets the tiny shapes.
SCALE = {"cpp": "small", "triton": "tiny"}
BACKENDS = ("cpp", "triton")
# (code generator, device) for the tables that also run on a GPU: both generators on CPU tensors,
# and Triton on CUDA tensors where a GPU is present. conftest turns Triton's interpreter on, so by
# default the CUDA cases run through it; `TRITON_INTERPRET=0 python -m pytest -k cuda FILES` runs
# them as compiled Triton kernels.
ON_DEVICES = [pytest.param("cpp", "cpu", id="cpp"), pytest.param("triton", "cpu", id="triton")] + (
    [pytest.param("triton", "cuda", id="triton-cuda")] if torch.cuda.is_available() else []
)


# The GPT-2 stack's blocks are all alike: two of them hold every kernel of a block and the residual
# stream from one block into the next; the workload's other two repeat them at twice the trace,
# compile and (under Triton's interpreter) run time.
GPT2_TEST_BLOCKS = 2


def dynamo_graph(fn: Callable, *args: Any) -> tuple[torch.fx.GraphModule, list]:
    """Dynamo's Torch-level graph of `fn(*args)` (one graph, no breaks) and its inputs in its own order."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return graphs[0]


def make_workload(name: str, scale: str, dtype: torch.dtype, device: str = "cpu") -> tuple[Any, tuple]:
    """WORKLOADS[name].make(scale, dtype, device), with a GPT-2 stack cut to GPT2_TEST_BLOCKS blocks."""
    fn, inputs = WORKLOADS[name].make(scale, dtype, device)
    if isinstance(fn, GPT2Stack):
        fn.blocks = fn.blocks[:GPT2_TEST_BLOCKS]
    return fn, inputs


def ember_compile(fn: Callable, backend: str, dynamic: bool | None = False, **options: Any) -> Callable:
    """torch.compile with ember in strict mode: a silent eager fallback would raise instead."""
    return torch.compile(fn, backend="ember", dynamic=dynamic, options={"strict": True, "backend": backend, **options})


def repro(**fields: Any) -> str:
    """A one-line description of a failing case: the pytest command that reruns it, and its parameters."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    parts = " ".join(f"{k}={_short(v)}" for k, v in fields.items())
    return f"repro: pytest '{test}'  # {parts}"


def _short(v: Any) -> str:
    if isinstance(v, torch.dtype):
        return str(v).replace("torch.", "")
    if isinstance(v, torch.Tensor):
        return f"{_short(v.dtype)}{list(v.shape)}"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, torch.Tensor) for x in v):
        return "(" + ", ".join(_short(x) for x in v) + ")"
    return str(v)


def tensors(out: Any) -> list[torch.Tensor]:
    """The tensors in a function's result (a tensor, or a tuple/list of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [o for o in out if isinstance(o, torch.Tensor)]


def assert_close(actual, expected, *, rtol: float, atol: float, what: str, line: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}\n{line}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}\n{line}"
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}\n{line}")


def max_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.detach().double() - ref.detach().double()).abs().max().item() if a.numel() else 0.0


def assert_not_worse(compiled, eager, ref, *, what: str, line: str, factor: float = 2.0, atol: float = 2**-8) -> None:
    """Low-precision check: compiled's error against an fp32 reference is not much above eager's.

    atol is relative to the reference's magnitude (bf16 keeps 8 significant bits).
    """
    assert compiled.shape == ref.shape, f"{what}: shape {tuple(compiled.shape)} != {tuple(ref.shape)}\n{line}"
    assert compiled.dtype == eager.dtype, f"{what}: dtype {compiled.dtype} != eager's {eager.dtype}\n{line}"
    assert torch.isfinite(compiled).all() == torch.isfinite(ref).all(), f"{what}: non-finite values\n{line}"
    c_err, e_err = max_error(compiled, ref), max_error(eager, ref)
    scale = max(1.0, ref.detach().abs().max().item()) if ref.numel() else 1.0
    bound = factor * e_err + atol * scale
    assert c_err <= bound, (
        f"{what}: compiled max error {c_err:.3g} vs fp32 reference exceeds {factor}x eager's {e_err:.3g} "
        f"+ {atol * scale:.3g}\n{line}"
    )


def forward_backward(
    fn: Callable, params: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], grad_seed: int, train: bool
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs of fn(*inputs), and gradients w.r.t. float inputs then params, for fixed random cotangents."""
    leaves = [x for x in inputs if x.requires_grad] + list(params)
    outs = tensors(fn(*inputs))
    if not train or not leaves:
        return [o.detach() for o in outs], []
    diff_outs = [o for o in outs if o.requires_grad]
    gen = torch.Generator().manual_seed(grad_seed)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=torch.float32).to(o.device, o.dtype) for o in diff_outs]
    grads = torch.autograd.grad(diff_outs, leaves, cotangents, allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    return [o.detach() for o in outs], list(grads)


def fresh_inputs(inputs: Sequence[torch.Tensor], dtype: torch.dtype | None = None, grad: bool = True) -> list:
    out = []
    for x in inputs:
        y = x.detach().clone()
        if dtype is not None and y.is_floating_point():
            y = y.to(dtype)
        if grad and y.is_floating_point():
            y.requires_grad_(True)
        out.append(y)
    return out


def params_of(fn: Callable) -> list[torch.Tensor]:
    return [p for p in fn.parameters() if p.requires_grad] if isinstance(fn, torch.nn.Module) else []


def upcast_copy(fn: Callable) -> Callable:
    """An fp32 copy of a module with the same (rounded) weights, for the low-precision reference."""
    return copy.deepcopy(fn).float() if isinstance(fn, torch.nn.Module) else fn


def randomize_bn(model: torch.nn.Module) -> torch.nn.Module:
    """The model in eval mode, its batch norms' statistics and affine parameters away from their
    identity defaults (so that folding or fusing them shows in the results)."""
    for bn in model.modules():
        if isinstance(bn, torch.nn.modules.batchnorm._BatchNorm):
            with torch.no_grad():
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2)
                bn.weight.uniform_(0.5, 2)
                bn.bias.uniform_(-1, 1)
    return model.eval()


@contextlib.contextmanager
def reports() -> Iterator[ExplainReport]:
    """Collect every graph ember compiles inside the block."""
    with collecting() as report:
        yield report


def assert_no_fallback(report: ExplainReport, line: str) -> None:
    bad = [(g.kind, g.fallback) for g in report.graphs if g.fallback]
    assert not bad, f"ember fell back to eager: {bad}\n{line}"


def compiled_graph(fn: Callable, inputs: Sequence, backend: str = "triton", **options: Any) -> tuple[Any, Any]:
    """fn compiled by ember (strict) and called once: its output and the report of its one graph."""
    with reports() as report:
        out = ember_compile(fn, backend, **options)(*inputs)
    assert_no_fallback(report, repro(options=options))
    (graph,) = report.graphs
    return out, graph


def explain_strict(fn: Callable, *args, backend: str = "cpp", **options) -> ExplainReport:
    with ember.config.override(strict=True, backend=backend, **options):
        return ember.explain(fn, *args)


def _vectorized_lines(kernel_source: str) -> set[int]:
    """The lines of a C++ kernel (numbered from 0) inside loops that GCC vectorizes, compiled as ember's
    C++ backend compiles it: `-fopt-info-vec-optimized` names a line inside each loop it vectorized."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from ember.backends.cpp import FLAGS, vector_math
    from ember.codegen.cpp import PRELUDE
    from ember.config import get as setting

    head = PRELUDE + "\n" + vector_math()[0] + "\n"
    first = head.count("\n") + 1  # the kernel's first line, numbered from 1
    with tempfile.TemporaryDirectory(prefix="ember-vec-") as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(head + kernel_source + "\n")
        flags = [f for f in FLAGS if f != "-shared"]
        cmd = [setting("cxx"), *flags, "-fopt-info-vec-optimized", "-c", str(src), "-o", str(Path(tmp) / "kernel.o")]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return {int(m) - first for m in re.findall(r"kernel\.cpp:(\d+):\d+: optimized: loop vectorized", proc.stderr)}


def _loop_end(lines: list[str], start: int) -> int:
    depth, end = 0, start
    for end in range(start, len(lines)):
        depth += lines[end].count("{") - lines[end].count("}")
        if depth == 0:
            break
    return end


def cpp_innermost_loop_vectorized(kernel_source: str) -> bool:
    """Whether GCC vectorizes the innermost loop of a C++ kernel (the last loop nest's: a kernel's main one)."""
    hits = _vectorized_lines(kernel_source)
    lines = kernel_source.splitlines()
    start = max(i for i, line in enumerate(lines) if line.strip().startswith("for ("))
    end = _loop_end(lines, start)
    return any(start <= h <= end for h in hits)


def cpp_simd_loops_vectorized(kernel_source: str) -> list[bool]:
    """For each loop of a C++ kernel under `#pragma omp simd`, in order, whether GCC vectorizes it."""
    hits = _vectorized_lines(kernel_source)
    lines = kernel_source.splitlines()
    starts = [i + 1 for i, line in enumerate(lines) if line.strip() == "#pragma omp simd"]
    return [any(s <= h <= _loop_end(lines, s) for h in hits) for s in starts]
