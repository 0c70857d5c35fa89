"""Training workloads for the distributed bench mode (distributed.py): a model, its blocks, its batches.

Each workload builds a model whose repeated blocks are what FSDP2 shards one by one (and what
regional compilation compiles), the batch of a step on a rank (different data on each rank, the
same on every run), and its loss:

- `tiny`: two residual MLP blocks of width 256 on random vectors, MSE loss (the CPU's: seconds);
- `gpt2`: GPT-2 124M, config-built with transformers (12 layers, 768 wide, no dropout), next-token
  cross entropy on random tokens;
- `llama_1b`: a Llama-style ~1.1B model (TinyLlama's shape: 22 layers, 2048 wide, grouped-query
  attention), config-built with transformers, next-token cross entropy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class DistWorkload:
    name: str
    build: Callable[[], nn.Module]  # on the CPU, float32, seeded by the caller
    blocks: Callable[[nn.Module], list[nn.Module]]  # the repeated blocks (FSDP2 units, regions to compile)
    batch: Callable[[int, int, torch.device], tuple[torch.Tensor, torch.Tensor]]  # (step, rank) -> inputs, targets
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str
    requires: str | None = None  # a package it needs


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 2 * d)
        self.fc2 = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class TinyNet(nn.Module):
    def __init__(self, d: int = 256, blocks: int = 2, out: int = 8):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(d) for _ in range(blocks))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _Logits(nn.Module):
    """A transformers causal LM returning its logits only, so compilers see one tensor out."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def _tiny_batch(step: int, rank: int, device: torch.device):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 8, 256, generator=gen).to(device), torch.randn(4, 8, 8, generator=gen).to(device)


def _token_batch(vocab: int, batch: int, seq: int):
    def make(step: int, rank: int, device: torch.device):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen).to(device)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    return make


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=12, n_embd=768, n_head=12, n_positions=1024, use_cache=False)
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.0
    return _Logits(GPT2LMHeadModel(cfg))


def _llama_1b() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        use_cache=False,
    )
    return _Logits(LlamaForCausalLM(cfg))


WORKLOADS = {
    w.name: w
    for w in (
        DistWorkload(
            "tiny",
            TinyNet,
            lambda m: list(m.blocks),
            _tiny_batch,
            nn.functional.mse_loss,
            "2 MLP blocks, 256 wide, 4x8 vectors per rank",
        ),
        DistWorkload(
            "gpt2",
            _gpt2,
            lambda m: list(m.model.transformer.h),
            _token_batch(50257, 8, 512),
            _next_token_loss,
            "GPT-2 124M, 8x512 tokens per rank",
            requires="transformers",
        ),
        DistWorkload(
            "llama_1b",
            _llama_1b,
            lambda m: list(m.model.model.layers),
            _token_batch(32000, 2, 1024),
            _next_token_loss,
            "Llama-style 1.1B, 2x1024 tokens per rank",
            requires="transformers",
        ),
    )
}
