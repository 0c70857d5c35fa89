"""Every layer of a kernel in ember.explain: the Python lines and ATen ops it came from, its source, and
its machine code (C++ -> x86 assembly here; Triton's source under its interpreter, whose other layers say
why they are missing); EMBER_DEBUG=4 prints the machine code; the occupancy arithmetic of GPU kernels."""

from __future__ import annotations

import io
import logging

import pytest
import torch

import ember
from ember.backends.layers import GPU_LAYERS, occupancy, split_functions
from tests.helpers import explain_strict


def _gelu_sum(x, w):
    y = x @ w
    z = torch.nn.functional.gelu(y) * 2.0
    return z.sum(-1)


def _inputs():
    return torch.randn(8, 16, requires_grad=True), torch.randn(16, 32)


@pytest.fixture(scope="module")
def report():
    return explain_strict(_gelu_sum, *_inputs(), backend="cpp")


def test_kernels_name_their_source_lines_and_ops(report):
    forward = report.graphs[0]
    here = __file__
    gelu_line = next(loc for loc, (code, _) in forward.source_lines.items() if "gelu(y)" in code)
    assert gelu_line.startswith(here), forward.source_lines
    code, ops = forward.source_lines[gelu_line]
    assert "erf" in ops and "gelu" in code, (code, ops)
    (kernel,) = [k for k in forward.kernels if "erf" in k.ops]
    assert gelu_line in kernel.lines, (kernel.lines, forward.source_lines)
    # The product is ember's C++ GEMM template (the GELU's row sum does not join it): a kernel of its own line.
    (product,) = [k for k in forward.kernels if "mm" in k.ops]
    assert not forward.externs, forward.externs
    assert any("x @ w" in forward.source_lines[loc][0] for loc in product.lines), product.lines
    backward = report.graphs[1]
    assert any(gelu_line in k.lines for k in backward.kernels), [k.lines for k in backward.kernels]


def test_cpu_kernels_show_their_assembly(report):
    for graph in report.graphs:
        layers = graph.layers()
        assert set(layers) == {k.name for k in graph.kernels}
        for k in graph.kernels:
            kl = layers[k.name]
            assert list(kl.layers) == ["C++", "x86 assembly"], (kl.layers.keys(), kl.missing)
            assert f'extern "C" void {k.name}(' in kl.layers["C++"]
            asm = kl.layers["x86 assembly"]
            assert "ret" in asm and kl.resources["instructions"] > 10, asm[:500]


def test_interpreted_triton_kernels_show_their_source_and_why_nothing_else():
    x = torch.randn(8, 16)
    report = explain_strict(lambda t: torch.relu(t) * 3, x, backend="triton")
    (graph,) = report.graphs
    (kl,) = graph.layers().values()
    assert list(kl.layers) == ["Triton"] and "@triton.jit" in kl.layers["Triton"], kl.layers
    assert set(kl.missing) == set(GPU_LAYERS[1:]) and "interpreter" in kl.missing["SASS"], kl.missing


def test_debug_4_prints_machine_code():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("ember")
    logger.addHandler(handler)
    try:
        with ember.config.override(debug=4, backend="cpp", strict=True):
            x = torch.randn(64)
            torch.testing.assert_close(
                torch.compile(lambda t: torch.tanh(t) + 1, backend="ember")(x), torch.tanh(x) + 1
            )
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "=== asm: inference kernels ===" in text and "x86 assembly" in text, text[-2000:]
    assert "vector width" in text, text[-2000:]


def test_split_functions_keeps_each_function_and_its_openmp_body():
    asm = (
        "\t.text\n\t.globl\tk0\n\t.type\tk0, @function\nk0:\n.LFB1:\n\t.cfi_startproc\n\tmovl\t$1, %eax\n\tret\n"
        "\t.size\tk0, .-k0\n\t.type\tk0._omp_fn.0, @function\nk0._omp_fn.0:\n\tvaddps\t%ymm0, %ymm1, %ymm2\n"
        "\tret\n\t.size\tk0._omp_fn.0, .-k0._omp_fn.0\n"
    )
    functions = split_functions(asm)
    assert list(functions) == ["k0", "k0._omp_fn.0"]
    assert "cfi" not in functions["k0"] and "movl" in functions["k0"]
    assert "vaddps" in functions["k0._omp_fn.0"]


def test_occupancy_is_limited_by_registers_threads_or_shared_memory():
    h100 = {"regs_per_sm": 65536, "threads_per_sm": 2048, "shared_per_sm": 233472, "blocks_per_sm": 32}
    assert occupancy(32, 0, 4, h100) == (16, 1.0)  # threads: 2048 / 128
    assert occupancy(128, 0, 4, h100) == (4, 0.25)  # registers: 65536 / (128 * 128)
    assert occupancy(32, 100_000, 4, h100) == (2, 0.125)  # shared memory: 233472 // 100000
    assert occupancy(255, 0, 8, h100)[0] == 1  # 256 registers a thread rounded: one 8-warp block


def test_gpu_resources_of_a_compiled_kernel():
    from types import SimpleNamespace

    from ember.backends.layers import disassemble, gpu_resources

    h100 = {"regs_per_sm": 65536, "threads_per_sm": 2048, "shared_per_sm": 233472, "blocks_per_sm": 32}
    compiled = SimpleNamespace(metadata=SimpleNamespace(num_warps=8, shared=16384), n_regs=64, n_spills=2)
    res = gpu_resources(compiled, h100)
    assert res == {
        "registers": 64,
        "spills": 2,
        "shared bytes": 16384,
        "warps": 8,
        "blocks/SM": 4,  # registers: 65536 / (64 * 256)
        "occupancy": "50%",
    }
    assert disassemble(None) == ("", "the compiled kernel holds no cubin")
