"""Which of ATen's SDPA kernels AOTAutograd may trace a graph that needs gradients into.

SDPA is one op in Dynamo's graph; AOTAutograd's trace resolves it, forward and backward, to one of
ATen's kernels, and on Hopper torch 2.11 picks cuDNN's for most calls. torch 2.11 caches cuDNN's
backward plans by the query's, key's and value's sizes and strides only, not by the strides of the
output gradient: a backward whose gradient is laid out otherwise than at the call that built the
plan computes wrong gradients, with no error. Which layout comes first is up to whoever runs a
backward of those shapes first in the process (eager code, another graph), so no layout ember
could choose is safe. On an H100, 13 of 76 compiled training cases had query, key and value
gradients 46-525 times eager's error; in another process eager itself was wrong in 7 of them
(docs/bench/h100.md, h200.md).

So a graph on a CUDA device that calls SDPA and needs gradients is traced with cuDNN's attention
disabled: torch's next choice (flash attention, else memory-efficient, else math) has no such
cache. ember then never runs cuDNN's attention backward. Inference graphs keep torch's choice
(cuDNN's forward allocates its own output in the query's layout: nothing for a cache to get
wrong). The setting `sdpa_cudnn_training` lets the trace pick cuDNN again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import fx

from ember import config, log


@contextlib.contextmanager
def training_attention_kernels(gm: fx.GraphModule, example_inputs) -> Iterator[None]:
    """While the block runs (AOTAutograd's trace of `gm`), cuDNN's attention is off where `gm` is
    a CUDA graph that calls SDPA and needs gradients; the caller's flag comes back after."""
    if config.get("sdpa_cudnn_training") or not _needs_exclusion(gm, example_inputs):
        yield
        return
    enabled = torch._C._get_cudnn_sdp_enabled()
    torch._C._set_sdp_use_cudnn(False)
    log.artifact("patterns", "SDPA in a graph that needs gradients", "traced without cuDNN's attention kernel")
    try:
        yield
    finally:
        torch._C._set_sdp_use_cudnn(enabled)


def _needs_exclusion(gm: fx.GraphModule, example_inputs) -> bool:
    if not torch.is_grad_enabled():
        return False
    if not any(isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs):
        return False  # AOTAutograd traces an inference graph: no backward
    if not any(_calls_sdpa(m) for m in gm.modules() if isinstance(m, fx.GraphModule)):
        return False
    return _on_cuda(gm, example_inputs)


def _calls_sdpa(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)


def _on_cuda(gm: fx.GraphModule, example_inputs) -> bool:
    from ember.pipeline import graph_device

    return graph_device(gm, example_inputs).type == "cuda"
