"""Which of ATen's SDPA kernels AOTAutograd may trace a graph that needs gradients into.

SDPA is one op in Dynamo's graph; AOTAutograd's trace resolves it, forward and backward, to one of
ATen's kernels, and on Hopper torch 2.11 picks cuDNN's for most calls. torch 2.11 caches cuDNN's
backward plans by the query's, key's and value's sizes and strides only, not by the strides of the
output gradient: a backward whose gradient is laid out otherwise than at the call that built the
plan computes wrong gradients, with no error. Which layout comes first is up to whoever runs a
backward of those shapes first in the process (eager code, another graph), so no layout ember
could choose is safe. On an H100, 13 of 76 compiled training cases had query, key and value
gradients 46-525 times eager's error (docs/bench/h100.md); in an eager probe, cuDNN's gradients
were wrong in 5 of 9 layout cases (docs/bench/h200-sdpa/eager-flash-vs-cudnn.txt).

So a CUDA graph that calls SDPA and may need gradients (a tensor input or parameter that requires
them, under grad mode or a graph that turns it on) is traced with cuDNN's attention disabled:
torch's next choice (flash attention, else memory-efficient, else math) has no such cache. Inference graphs keep torch's choice (cuDNN's forward allocates its own output: nothing
for a cache to get wrong). Where such a graph runs eagerly instead (ember fell back), its calls run
under the same exclusion (`eager_without_cudnn_attention`), so the kernels it picks are the ones a
compile would have traced. The setting `sdpa_cudnn_training` lets the trace pick cuDNN again.

The flag is process-wide while a trace runs: Dynamo compiles one frame at a time, but another
thread's eager SDPA meanwhile runs without cuDNN (slower, not wrong), and another thread leaving an
`sdpa_kernel` block meanwhile could turn cuDNN back on mid-trace; `check_traced` warns where a
backward graph calls cuDNN's attention anyway.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import fx

from ember import config, log


@contextlib.contextmanager
def training_attention_kernels(excluded: bool) -> Iterator[None]:
    """While the block runs (AOTAutograd's trace of a graph), cuDNN's attention is off where
    `excluded` (excludes_cudnn of that graph); the caller's flag comes back after."""
    if not excluded:
        yield
        return
    with _cudnn_attention_off():
        if not (torch._C._get_flash_sdp_enabled() or torch._C._get_mem_efficient_sdp_enabled()):
            log.warn(
                "ember: SDPA in a graph that needs gradients is traced without cuDNN's attention (torch 2.11 "
                "miscomputes some of its gradients), and flash and memory-efficient attention are disabled: "
                "it takes the math kernel. Setting sdpa_cudnn_training=True keeps cuDNN's."
            )
        log.artifact("patterns", "SDPA in a graph that needs gradients", "traced without cuDNN's attention kernel")
        yield


def excludes_cudnn(gm: fx.GraphModule, example_inputs) -> bool:
    """Whether `gm` is traced (or, fallen back, run) without cuDNN's attention."""
    if config.get("sdpa_cudnn_training"):
        return False
    sdpa = [n for m in gm.modules() if isinstance(m, fx.GraphModule) for n in m.graph.nodes if _is_sdpa(n)]
    if not sdpa or not may_need_gradients(gm, example_inputs):
        return False
    return any(_on_cuda(n) for n in sdpa) or graph_on_cuda(gm, example_inputs)


def eager_without_cudnn_attention(run: Callable) -> Callable:
    """`run` (a graph ember runs eagerly) with cuDNN's attention off during each call: its forward
    picks the kernel whose backward autograd then runs."""

    @functools.wraps(run)
    def call(*args, **kwargs):
        with _cudnn_attention_off():
            return run(*args, **kwargs)

    return call


def check_traced(gm: fx.GraphModule, kind: str) -> None:
    """Warn where a backward graph traced while the exclusion should hold calls cuDNN's attention."""
    if kind != "backward" or config.get("sdpa_cudnn_training"):
        return
    cudnn_backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
    if any(n.op == "call_function" and n.target is cudnn_backward for n in gm.graph.nodes):
        log.warn(
            "ember: a backward graph calls cuDNN's attention backward, whose gradients torch 2.11 can "
            "miscompute silently (another thread enabled it during the trace?); compare with eager"
        )


@contextlib.contextmanager
def _cudnn_attention_off() -> Iterator[None]:
    enabled = torch._C._get_cudnn_sdp_enabled()
    try:
        torch._C._set_sdp_use_cudnn(False)
        yield
    finally:
        torch._C._set_sdp_use_cudnn(enabled)


def may_need_gradients(gm: fx.GraphModule, example_inputs) -> bool:
    """A tensor input or parameter that requires gradients, where grad mode is on now or the graph
    turns it on (`with torch.enable_grad()` inside a `no_grad` call): AOTAutograd then traces a
    backward unless no output requires gradients."""
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)] + list(gm.parameters())
    if not any(t.requires_grad for t in tensors):
        return False
    return torch.is_grad_enabled() or any(
        n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in gm.graph.nodes
    )


def _is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.scaled_dot_product_attention


def _on_cuda(node: fx.Node) -> bool:
    query = node.args[0] if node.args else node.kwargs.get("query")
    value = query.meta.get("example_value") if isinstance(query, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def graph_on_cuda(gm: fx.GraphModule, example_inputs) -> bool:
    from ember.pipeline import graph_device

    return graph_device(gm, example_inputs).type == "cuda"
