"""Host cost per call of a compiled graph, guards excluded, and the host-bound workloads that show it.

What is timed: the compiled graph object itself, called with the inputs Dynamo compiled it for.
Each compiler is compiled a second time through a backend that keeps what the real backend returns
(AOTAutograd's compiled function, with its runtime wrappers: each compiler pays those) and the
example inputs; calling that function directly skips Dynamo's guards and frame evaluation, which
are the same for every compiler and not the compiler's host program. Eager's figure is the
function called directly. On a GPU the host's clock runs around calls launched back to back while
the device sleeps (`Timer.host_ms`), so no launch waits for the device; on a CPU, where the host
runs the kernels too, the programs are tiny and the figure is the median call.

`one_kernel` is one pointwise kernel; `hundred_kernels` alternates a column and a row
normalization, 50 times: 101 kernels in ember (no two of them fuse: each reads the whole result of
the one before), so its host cost is that of about a hundred launches.
"""

from __future__ import annotations

import functools

import torch

from ember.tools.bench.built import Built


def one_kernel(x: torch.Tensor) -> torch.Tensor:
    return x * 2.0 + 1.0


def hundred_kernels(x: torch.Tensor) -> torch.Tensor:
    for _ in range(50):
        x = x - x.mean(0, keepdim=True)
        x = x * torch.rsqrt((x * x).mean(1, keepdim=True) + 1.0)
    return x


def build(fn):
    def make(size, device):
        return Built(fn, (torch.randn(size, device=device),))

    return make


def capturing(compiler: str):
    """(fn compiled by `compiler` through a backend that keeps each graph, that list of
    (compiled graph, example inputs))."""
    name, _, mode = compiler.partition(":")
    if name == "inductor":
        inner = torch._TorchCompileInductorWrapper(mode or None, None, None)
    elif name == "ember":
        from ember.frontend.backend import ember_backend

        inner = functools.partial(ember_backend, mode=mode or None)
    else:
        raise ValueError(f"unknown compiler {compiler!r}")
    graphs: list[tuple] = []

    def backend(gm, example_inputs):
        compiled = inner(gm, example_inputs)
        graphs.append((compiled, list(example_inputs)))
        return compiled

    return backend, graphs


def graph_call(fn, compiler: str, inputs: tuple, train: bool):
    """A function that calls `compiler`'s compiled graph of fn(*inputs) directly (no guards); None
    where there is not exactly one graph (a graph break) or the step trains (a backward is not
    called as one graph)."""
    if train:
        return None
    if compiler == "eager":
        return lambda: fn(*inputs)
    backend, graphs = capturing(compiler)
    compiled = torch.compile(fn, backend=backend)
    with torch.no_grad():
        compiled(*inputs)
    if len(graphs) != 1:
        return None
    graph, example = graphs[0]
    return lambda: graph(*example)  # AOTAutograd's function, as Dynamo's code calls it


def host_us(call, timer) -> float:
    """µs of host time per call (module docstring)."""
    with torch.no_grad():
        if timer.device.type == "cuda":
            return 1000 * timer.host_ms(call)
        return 1000 * timer.median_ms(call)
