"""The programs ember is checked and measured on, shared by the demo, the tests and GPU runs.

Each workload is a function (or module) plus a maker of inputs at a named scale: "tiny" for
Triton's CPU interpreter, "small" for CPU tests, "cpu" for the CPU demo (each call a millisecond
or more on a 2-core CPU, long enough to time), "gpu" for the GPU machine.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


def pointwise3(x):
    return torch.relu(x) * 0.5 + 1


def gelu_tanh(x):
    """GELU's tanh approximation written out: 7 pointwise ops."""
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x)))


def softmax_manual(x):
    m = x.amax(-1, keepdim=True)
    e = torch.exp(x - m)
    return e / e.sum(-1, keepdim=True)


class LayerNormGelu(nn.Module):
    """gelu(layer_norm(x + r)); also returns h = x + r (a residual stream keeps it)."""

    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)

    def forward(self, x, r):
        h = x + r
        return F.gelu(self.norm(h)), h


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int, depth: int = 3):
        super().__init__()
        dims = [d] + [hidden] * (depth - 1) + [d]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x):
        for k, layer in enumerate(self.layers):
            x = layer(x)
            if k < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def causal(b, h, q, kv):
    """FlexAttention's mask_mod of causal attention."""
    return q >= kv


def causal_block_mask(seq: int, device):
    """FlexAttention's BlockMask of causal attention over `seq` tokens, one for every batch and head."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(causal, None, None, seq, seq, device=device)


class GPT2Block(nn.Module):
    """A pre-norm GPT-2 block. attention="sdpa": causal F.scaled_dot_product_attention; "flex":
    flex_attention with the causal BlockMask in `block_mask`, which the builder sets (it depends on
    the sequence length and the device, and is made once, not per call)."""

    def __init__(self, d: int, heads: int, attention: str = "sdpa"):
        super().__init__()
        if attention not in ("sdpa", "flex"):
            raise ValueError(f"attention {attention!r}: 'sdpa' or 'flex'")
        self.heads, self.attention = heads, attention
        self.block_mask = None
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attention == "flex":
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(q, k, v, block_mask=self.block_mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2Stack(nn.Module):
    def __init__(self, d: int, heads: int, layers: int = 4, attention: str = "sdpa"):
        super().__init__()
        self.blocks = nn.Sequential(*[GPT2Block(d, heads, attention) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)

    def set_block_mask(self, block_mask) -> None:
        """The BlockMask every flex block attends with (causal_block_mask(seq, device))."""
        for block in self.blocks:
            block.block_mask = block_mask

    def forward(self, x):
        return self.ln_f(self.blocks(x))


@dataclass
class Workload:
    name: str
    make: Callable[[str, torch.dtype, str], tuple[Callable, tuple]]  # (scale, dtype, device) -> (fn, inputs)
    expected_kernels: int | None = None  # inference kernels ember must make (None: not pinned)


_SIZES = {
    # name: {scale: shape}
    "pointwise3": {"tiny": (8, 32), "small": (256, 512), "cpu": (2048, 2048), "gpu": (4096, 4096)},
    "gelu_tanh": {"tiny": (8, 32), "small": (256, 512), "cpu": (2048, 2048), "gpu": (8192, 8192)},
    "softmax": {"tiny": (8, 32), "small": (256, 1024), "cpu": (2048, 2048), "gpu": (8192, 8192)},
    "layernorm_gelu": {"tiny": (8, 32), "small": (512, 1024), "cpu": (2048, 1024), "gpu": (8192, 4096)},
    "mlp": {"tiny": (4, 16, 32), "small": (64, 256, 512), "cpu": (256, 256, 512), "gpu": (8192, 1024, 4096)},
    "gpt2_block": {"tiny": (2, 8, 32, 2), "small": (4, 64, 128, 4), "cpu": (4, 64, 128, 4), "gpu": (16, 1024, 768, 12)},
}


def _rand(shape, dtype, device, requires_grad=False):
    return torch.randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def _fn_workload(name, fn):
    def make(scale, dtype, device):
        return fn, (_rand(_SIZES[name][scale], dtype, device),)

    return make


def _make_layernorm_gelu(scale, dtype, device):
    rows, d = _SIZES["layernorm_gelu"][scale]
    m = LayerNormGelu(d).to(device=device, dtype=dtype)
    with torch.no_grad():  # non-trivial affine parameters
        m.norm.weight.normal_()
        m.norm.bias.normal_()
    return m, (_rand((rows, d), dtype, device), _rand((rows, d), dtype, device))


def _make_mlp(scale, dtype, device):
    rows, d, hidden = _SIZES["mlp"][scale]
    return MLP(d, hidden).to(device=device, dtype=dtype), (_rand((rows, d), dtype, device),)


def _make_gpt2(scale, dtype, device):
    b, t, d, h = _SIZES["gpt2_block"][scale]
    return GPT2Stack(d, h).to(device=device, dtype=dtype), (_rand((b, t, d), dtype, device),)


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload("pointwise3", _fn_workload("pointwise3", pointwise3), expected_kernels=1),
        Workload("gelu_tanh", _fn_workload("gelu_tanh", gelu_tanh), expected_kernels=1),
        Workload("softmax", _fn_workload("softmax", softmax_manual), expected_kernels=1),
        Workload("layernorm_gelu", _make_layernorm_gelu, expected_kernels=1),
        Workload("mlp", _make_mlp),
        Workload("gpt2_block", _make_gpt2),
    ]
}


# Programs used by the benchmark harness (ember/tools/bench); not entries of WORKLOADS, whose
# members the tests iterate over.


class RMSNorm(nn.Module):
    """LLaMA's RMSNorm: normalize in float32, cast back, scale by a weight."""

    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LinearBiasGelu(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out)

    def forward(self, x):
        return F.gelu(self.linear(x))


def attention_manual(q, k, v):
    """Attention as matmul, scale, softmax, matmul (no fused kernel)."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    return torch.softmax(scores, dim=-1) @ v


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def cross_entropy(logits, targets):
    return F.cross_entropy(logits, targets)


class TinyMLP(nn.Module):
    """depth × (Linear(d, d) + GELU): at batch 1 every kernel is tiny, so launches dominate."""

    def __init__(self, d: int, depth: int):
        super().__init__()
        self.net = nn.Sequential(*[m for _ in range(depth) for m in (nn.Linear(d, d), nn.GELU())])

    def forward(self, x):
        return self.net(x)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class LlamaBlock(nn.Module):
    """A LLaMA-style decoder block: RMSNorm, rotary embeddings, causal SDPA, SwiGLU MLP."""

    def __init__(self, d: int, heads: int, hidden: int, max_seq: int):
        super().__init__()
        self.heads = heads
        self.attn_norm = RMSNorm(d)
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)
        self.mlp_norm = RMSNorm(d)
        self.w_gate = nn.Linear(d, hidden, bias=False)
        self.w_up = nn.Linear(d, hidden, bias=False)
        self.w_down = nn.Linear(hidden, d, bias=False)
        head_dim = d // heads
        inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(max_seq).float(), inv_freq)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x):
        B, S, C = x.shape
        h = self.attn_norm(x)
        q, k, v = (w(h).view(B, S, self.heads, C // self.heads).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        cos, sin = self.cos[:S], self.sin[:S]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(y.transpose(1, 2).reshape(B, S, C))
        h = self.mlp_norm(x)
        return x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 convolutions with batch norm, and a 1×1 projection on the residual
    path where the block strides or widens."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    """A ResNet of basic blocks: a 7×7 stem and max pool, `depths[i]` blocks of width `widths[i]` (each
    stage after the first halves the resolution), global average pool, a linear classifier.
    ResNet(64, (64, 128, 256, 512), (2, 2, 2, 2)) is ResNet-18."""

    def __init__(self, stem: int, widths: tuple[int, ...], depths: tuple[int, ...], classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem), nn.ReLU(), nn.MaxPool2d(3, 2, 1)
        )
        blocks, cin = [], stem
        for stage, (width, depth) in enumerate(zip(widths, depths)):
            for k in range(depth):
                blocks.append(BasicBlock(cin, width, 2 if stage > 0 and k == 0 else 1))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))
