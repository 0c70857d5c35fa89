"""The benchmark's workloads: programs, sizes per scale, and the modes each one runs in.

Sizes are given per scale: "gpu" (the sizes the issue names), "cpu" (the same programs scaled
down for a 2-core machine: fewer rows, fewer layers, smaller batches; the memory-bound micro
workloads keep 32-64 MB per tensor so that they do not run from a CPU's last-level cache),
"tiny" (the CI test).
The "zoo" group (zoo.py) holds real architectures built from configs; "cpu_models" (cpu_models.py)
small float32 configs of real models for CPU inference; "dynamic" (dynamic.py) one compiled program
called at many sizes.
Workloads that need transformers, timm or torchvision are skipped with a note when the package does
not import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ember.tools import workloads as programs
from ember.tools.bench import (
    cpu_models,
    decode,
    dynamic,
    flex_workloads,
    host_cost,
    jax_step,
    optimizers,
    train_loop,
    zoo,
)
from ember.tools.bench.built import Built


@dataclass(frozen=True)
class Workload:
    name: str
    group: str  # one of GROUPS
    dtype: str  # what the table shows: "f32", "bf16", "bf16 autocast"
    sizes: dict[str, tuple]
    build: Callable[[tuple, torch.device], Built] | None
    modes: tuple[str, ...] = ("inference",)
    requires: str | None = None  # optional package the workload imports
    describe: Callable[[tuple], str] = field(default=lambda size: "×".join(map(str, size)))
    host_cost: bool = False  # also time each compiled graph's host cost, guards excluded (host_cost.py)
    # A workload that measures itself: runner(case, settings, record) -> the record (decode.py).
    runner: Callable | None = None
    # Other frameworks' programs of the same step: others(case, settings) -> {column: result} (jax_step.py).
    others: Callable | None = None

    def instance(self, scale: str, device: torch.device, mode: str) -> Built:
        """The workload built at `scale`, a module set to the mode's behaviour: `train()` when
        training (batch norm normalizes by the batch's statistics and updates its running ones),
        `eval()` for inference."""
        built = self.build(self.sizes[scale], device)
        if isinstance(built.fn, nn.Module):
            built.fn.train(mode == "train")
        return built

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype whose matmul rate bounds this workload's arithmetic."""
        return torch.float32 if self.dtype == "f32" else torch.bfloat16


def _dtype(w: str) -> torch.dtype:
    return torch.float32 if w == "f32" else torch.bfloat16


def _randn(shape, dtype, device):
    return torch.randn(shape, dtype=dtype, device=device)


def _fn(fn, dtype: str):
    def build(size, device):
        return Built(fn, (_randn(size, _dtype(dtype), device),))

    return build


def _module(m: nn.Module, device, dtype: torch.dtype) -> nn.Module:
    return m.to(device=device, dtype=dtype)


def _layernorm_residual(size, device):
    d = size[1]
    m = _module(programs.LayerNormGelu(d), device, torch.bfloat16)
    with torch.no_grad():
        m.norm.weight.normal_()
        m.norm.bias.normal_()
    return Built(m, (_randn(size, torch.bfloat16, device), _randn(size, torch.bfloat16, device)))


def _rmsnorm(size, device):
    d = size[1]
    m = _module(programs.RMSNorm(d), device, torch.bfloat16)
    with torch.no_grad():
        m.weight.normal_()
    return Built(m, (_randn(size, torch.bfloat16, device),))


def _linear_bias_gelu(size, device):
    rows, k, n = size
    m = _module(programs.LinearBiasGelu(k, n), device, torch.bfloat16)
    return Built(m, (_randn((rows, k), torch.bfloat16, device),))


def _qkv(fn):
    def build(size, device):
        b, h, s, d = size
        return Built(fn, tuple(_randn((b, h, s, d), torch.bfloat16, device) for _ in range(3)))

    return build


def _cross_entropy(size, device):
    rows, vocab = size
    targets = torch.randint(0, vocab, (rows,), device=device)
    return Built(programs.cross_entropy, (_randn((rows, vocab), torch.bfloat16, device), targets))


def _tiny_mlp(size, device):
    batch, d, depth = size
    return Built(
        _module(programs.TinyMLP(d, depth), device, torch.float32), (_randn((batch, d), torch.float32, device),)
    )


def _gpt2_stack(attention: str):
    """GPT2Stack with this attention ("sdpa" or "flex", whose causal BlockMask is made here, once)."""

    def build(size, device):
        b, t, d, heads, layers = size
        m = _module(programs.GPT2Stack(d, heads, layers, attention), device, torch.bfloat16)
        if attention == "flex":
            m.set_block_mask(programs.causal_block_mask(t, device))
        return Built(m, (_randn((b, t, d), torch.bfloat16, device),))

    return build


_gpt2_blocks = _gpt2_stack("sdpa")


def _llama_block(size, device):
    b, s, d, heads, hidden = size
    m = _module(programs.LlamaBlock(d, heads, hidden, s), device, torch.bfloat16)
    with torch.no_grad():
        m.attn_norm.weight.normal_(1.0, 0.1)
        m.mlp_norm.weight.normal_(1.0, 0.1)
    return Built(m, (_randn((b, s, d), torch.bfloat16, device),))


class _Field(nn.Module):
    """Returns one field of a transformers model's output, so every output is a tensor."""

    def __init__(self, model: nn.Module, field: str):
        super().__init__()
        self.model = model
        self.field = field

    def forward(self, ids):
        return getattr(self.model(input_ids=ids), self.field)


def _hf_gpt2(size, device):
    from transformers import GPT2Config, GPT2LMHeadModel

    batch, seq, layers = size
    cfg = GPT2Config(
        n_layer=layers,
        n_positions=max(1024, seq),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        use_cache=False,
        attn_implementation="sdpa",
    )
    m = _module(_Field(GPT2LMHeadModel(cfg), "logits"), device, torch.bfloat16)
    return Built(m, (torch.randint(0, cfg.vocab_size, (batch, seq), device=device),))


def _hf_bert(size, device):
    from transformers import BertConfig, BertModel

    batch, seq, layers = size
    cfg = BertConfig(
        num_hidden_layers=layers,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    m = _module(_Field(BertModel(cfg, add_pooling_layer=False), "last_hidden_state"), device, torch.bfloat16)
    return Built(m, (torch.randint(0, cfg.vocab_size, (batch, seq), device=device),))


def _torchvision(name):
    def build(size, device):
        import torchvision.models as tvm

        batch, res = size
        kwargs = {"image_size": res} if name.startswith("vit") else {}
        m = getattr(tvm, name)(weights=None, **kwargs).to(device=device, memory_format=torch.channels_last)
        x = _randn((batch, 3, res, res), torch.float32, device).contiguous(memory_format=torch.channels_last)
        return Built(m, (x,), autocast=torch.bfloat16)

    return build


def _shape(fmt: str) -> Callable[[tuple], str]:
    return lambda size: fmt.format(*size)


def _optimizer_workloads() -> list[Workload]:
    """opt_KIND over 50 × 1M fp32 parameters, and opt_KIND_gpt2 over GPT-2 124M's shapes in bf16."""
    out = []
    for kind in ("adamw", "adam", "sgd_momentum"):
        out.append(
            Workload(
                f"opt_{kind}",
                "optim",
                "f32",
                {"gpu": (50, 1 << 20), "cpu": (24, 1 << 18), "tiny": (4, 64)},
                optimizers.optimizer_step(kind, torch.float32),
                modes=("step",),
                describe=optimizers.describe,
            )
        )
        out.append(
            Workload(
                f"opt_{kind}_gpt2",
                "optim",
                "bf16",
                {
                    "gpu": ("gpt2", 12, 768, 50257, 1024),
                    "cpu": ("gpt2", 2, 256, 8192, 256),
                    "tiny": ("gpt2", 1, 16, 64, 8),
                },
                optimizers.optimizer_step(kind, torch.bfloat16),
                modes=("step",),
                describe=optimizers.describe,
                host_cost=True,  # a step of ~450 tensors: its host time is as long as its device time
            )
        )
    return out


_GPT2_STEP_SIZES = {"gpu": (8, 1024, 768, 12, 4), "cpu": (2, 128, 768, 12, 4), "tiny": (2, 8, 32, 2, 2)}


def _attention_workloads() -> list[Workload]:
    """FlexAttention programs and SDPA at the same shapes (flex_workloads.py), and gpt2_step's model
    with FlexAttention's causal BlockMask (gpt2_flex) beside the same model with SDPA (gpt2_sdpa)."""
    return [
        *(
            Workload(name, "flex", "bf16", sizes, build, modes=("inference", "train"), describe=flex_workloads.describe)
            for name, (build, sizes) in flex_workloads.PROGRAMS.items()
        ),
        *(
            Workload(
                name,
                "flex",
                "bf16",
                _GPT2_STEP_SIZES,
                _gpt2_stack(attention),
                modes=("inference", "train"),
                describe=_shape("{4} blocks, {0}×{1}×{2}, " + label),
            )
            for name, attention, label in (("gpt2_flex", "flex", "flex causal"), ("gpt2_sdpa", "sdpa", "SDPA causal"))
        ),
    ]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in [
        Workload(
            "pointwise3",
            "micro",
            "f32",
            {"gpu": (4096, 4096), "cpu": (4096, 4096), "tiny": (64, 64)},
            _fn(programs.pointwise3, "f32"),
        ),
        Workload(
            "gelu_tanh",
            "micro",
            "f32",
            {"gpu": (8192, 8192), "cpu": (4096, 4096), "tiny": (64, 64)},
            _fn(programs.gelu_tanh, "f32"),
        ),
        Workload(
            "softmax",
            "micro",
            "f32",
            {"gpu": (8192, 8192), "cpu": (4096, 4096), "tiny": (32, 64)},
            _fn(programs.softmax_manual, "f32"),
        ),
        Workload(
            "layernorm_residual",
            "micro",
            "bf16",
            {"gpu": (8192, 4096), "cpu": (4096, 4096), "tiny": (32, 64)},
            _layernorm_residual,
        ),
        Workload("rmsnorm", "micro", "bf16", {"gpu": (8192, 4096), "cpu": (4096, 4096), "tiny": (32, 64)}, _rmsnorm),
        Workload(
            "linear_bias_gelu",
            "micro",
            "bf16",
            {"gpu": (8192, 4096, 4096), "cpu": (512, 1024, 1024), "tiny": (16, 32, 32)},
            _linear_bias_gelu,
            describe=_shape("{0}×{1} @ {1}×{2}"),
        ),
        Workload(
            "attention",
            "micro",
            "bf16",
            {"gpu": (8, 16, 2048, 64), "cpu": (2, 4, 512, 64), "tiny": (1, 2, 16, 8)},
            _qkv(programs.attention_manual),
            describe=_shape("B{0} H{1} S{2} D{3}"),
        ),
        Workload(
            "sdpa_causal",
            "micro",
            "bf16",
            {"gpu": (8, 16, 2048, 64), "cpu": (2, 4, 512, 64), "tiny": (1, 2, 16, 8)},
            _qkv(programs.sdpa_causal),
            describe=_shape("B{0} H{1} S{2} D{3}"),
        ),
        Workload(
            "cross_entropy",
            "micro",
            "bf16",
            {"gpu": (8192, 50257), "cpu": (512, 50257), "tiny": (16, 1000)},
            _cross_entropy,
            describe=_shape("{0} rows × {1} vocab"),
        ),
        Workload(
            "tiny_mlp_b1",
            "micro",
            "f32",
            {"gpu": (1, 256, 16), "cpu": (1, 256, 16), "tiny": (1, 32, 4)},
            _tiny_mlp,
            describe=_shape("batch {0}, {2} × Linear({1})"),
        ),
        Workload(
            "gpt2_blocks",
            "model",
            "bf16",
            {"gpu": (16, 1024, 768, 12, 4), "cpu": (2, 128, 768, 12, 4), "tiny": (2, 8, 32, 2, 2)},
            _gpt2_blocks,
            modes=("inference", "train"),
            describe=_shape("{4} blocks, {0}×{1}×{2}"),
        ),
        Workload(
            "hf_gpt2",
            "model",
            "bf16",
            {"gpu": (8, 1024, 12), "cpu": (1, 128, 4), "tiny": (1, 16, 1)},
            _hf_gpt2,
            modes=("inference", "train"),
            requires="transformers",
            describe=_shape("{2} layers, {0}×{1} tokens"),
        ),
        Workload(
            "hf_bert",
            "model",
            "bf16",
            {"gpu": (32, 512, 12), "cpu": (2, 128, 4), "tiny": (1, 16, 1)},
            _hf_bert,
            modes=("inference", "train"),
            requires="transformers",
            describe=_shape("{2} layers, {0}×{1} tokens"),
        ),
        Workload(
            "llama_block",
            "model",
            "bf16",
            {"gpu": (4, 2048, 4096, 32, 11008), "cpu": (1, 256, 1024, 8, 2816), "tiny": (1, 16, 32, 2, 64)},
            _llama_block,
            modes=("inference", "train"),
            describe=_shape("{0}×{1}, d {2}, {3} heads, MLP {4}"),
        ),
        Workload(
            "resnet50",
            "model",
            "bf16 autocast",
            {"gpu": (64, 224), "cpu": (2, 128), "tiny": (1, 32)},
            _torchvision("resnet50"),
            modes=("inference", "train"),
            requires="torchvision",
            describe=_shape("batch {0}, {1}², channels_last"),
        ),
        Workload(
            "vit_b_16",
            "model",
            "bf16 autocast",
            {"gpu": (64, 224), "cpu": (2, 112), "tiny": (1, 32)},
            _torchvision("vit_b_16"),
            requires="torchvision",
            describe=_shape("batch {0}, {1}²"),
        ),
        Workload(
            "gpt2_step",
            "model",
            "bf16",
            _GPT2_STEP_SIZES,
            _gpt2_blocks,
            modes=("train",),
            describe=_shape("{4} blocks, {0}×{1}×{2}, + JAX/XLA"),
            others=jax_step.others,
        ),
        Workload(
            "gpt2_loop",
            "model",
            "bf16",
            {"gpu": (8, 1024, 768, 12, 4), "cpu": (2, 128, 768, 12, 4), "tiny": (2, 8, 32, 2, 2)},
            None,
            modes=("loop",),
            describe=train_loop.describe,
            runner=train_loop.run,
        ),
        *(
            Workload(
                name,
                "model",
                "bf16",
                sizes,
                None,
                modes=("decode",),
                requires="transformers",
                describe=decode.describe,
                runner=decode.run,
            )
            for name, sizes in (("llama_decode", decode.SIZES_B1), ("llama_decode_b8", decode.SIZES_B8))
        ),
        Workload(
            "host_1k",
            "host",
            "f32",
            {"gpu": (256,), "cpu": (256,), "tiny": (64,)},
            host_cost.build(host_cost.one_kernel),
            describe=_shape("1 kernel, {0} elements"),
            host_cost=True,
        ),
        Workload(
            "host_100k",
            "host",
            "f32",
            {"gpu": (64, 64), "cpu": (64, 64), "tiny": (8, 8)},
            host_cost.build(host_cost.hundred_kernels),
            describe=_shape("~100 kernels, {0}×{1}"),
            host_cost=True,
        ),
        *_optimizer_workloads(),
        *_attention_workloads(),
        *zoo.workloads(Workload),
        *cpu_models.workloads(Workload),
        *dynamic.workloads(Workload),
    ]
}


GROUPS = ("micro", "model", "host", "optim", "flex", "zoo", "cpu_models", "dynamic")


@dataclass(frozen=True)
class Case:
    """One row of the benchmark: a workload in one mode."""

    workload: Workload
    mode: str  # "inference" | "train"

    @property
    def key(self) -> str:
        return f"{self.workload.name}/{self.mode}"


def missing_requirement(w: Workload) -> str | None:
    """Why the workload cannot run here (its optional package does not import), or None."""
    if w.requires is None:
        return None
    try:
        importlib.import_module(w.requires)
    except Exception as e:  # noqa: BLE001 - a broken install raises more than ImportError (e.g. a CUDA-only torchvision)
        return f"{w.requires} not importable ({type(e).__name__}: {str(e)[:80]})"
    return None


def select(names: str = "all", modes: str = "inference,train") -> list[Case]:
    """The cases named by a comma-separated list ("all", group names "micro"/"model"/"zoo", workload names, or
    "workload/mode" for one case whatever `modes` says). Names add up: a workload named plainly (or in a group)
    and as "workload/mode" runs in the selected modes and that one. "all" is every group but the zoo and the CPU
    models, which are asked for by name ("zoo", "cpu_models")."""
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    chosen: list[Workload] = []
    only: dict[str, set[str]] = {}  # workload -> the modes "workload/mode" names asked for, where no plain name did
    whole: set[str] = set()  # workloads named plainly (alone or in a group): every selected mode
    for n in wanted:
        if "/" in n:
            name, mode = n.split("/", 1)
            if name not in WORKLOADS:
                raise ValueError(f"unknown workload {name!r} in {n!r}")
            if mode not in WORKLOADS[name].modes:
                raise ValueError(f"unknown case {n!r}: {name} runs in {', '.join(WORKLOADS[name].modes)}")
            only.setdefault(name, set()).add(mode)
            group = [WORKLOADS[name]]
        elif n == "all":
            group = [w for w in WORKLOADS.values() if w.group not in ("zoo", "cpu_models")]
        elif n in GROUPS:
            group = [w for w in WORKLOADS.values() if w.group == n]
        elif n in WORKLOADS:
            group = [WORKLOADS[n]]
        else:
            raise ValueError(f"unknown workload {n!r}; valid: all, {', '.join(GROUPS)}, {', '.join(WORKLOADS)}")
        if "/" not in n:
            whole.update(w.name for w in group)
        chosen += [w for w in group if w not in chosen]
    mode_set = {m.strip() for m in modes.split(",")}

    def selected(w: Workload, mode: str) -> bool:
        if mode in only.get(w.name, ()):
            return True
        if w.name in only and w.name not in whole:  # named only as workload/mode
            return False
        # A workload's own mode (an optimizer "step", a "decode" loop) is always selected.
        return mode in mode_set or mode not in ("inference", "train")

    return [Case(w, m) for w in chosen for m in w.modes if selected(w, m)]
