"""The zoo: real architectures from HF transformers, timm, torchvision, torch_geometric and torchaudio,
each built from a config with random weights (nothing is downloaded), in inference and in training.

Every model is wrapped so that it returns one tensor (a `_Field` of its output). Dropout is off
everywhere (configs' dropout probabilities are zeroed, `nn.Dropout` modules too), so a training
step is deterministic and can be checked against its float64 reference. Sizes per scale:
"gpu" — widths and batch sizes of the kind people train and serve (fewer layers than the full
models, so that one run of the whole zoo fits an H100); "cpu" and "tiny" — a few layers of small width.
A workload whose package does not import is skipped with a note (`requires=`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch
from torch import nn

from ember.tools.bench.built import Built

# (batch, sequence, layers, width, vocab) of the language models per scale.
LM = {"gpu": (8, 1024, 4, 2048, 32000), "cpu": (1, 128, 2, 256, 4096), "tiny": (1, 16, 1, 32, 128)}
# (batch, resolution) of the vision models per scale.
VISION = {"gpu": (64, 224), "cpu": (4, 96), "tiny": (4, 64)}


class _Field(nn.Module):
    """Calls `model` with its inputs named `names` and returns one field of its output (or the first
    element of a tuple), so every output is a tensor."""

    def __init__(self, model: nn.Module, names: tuple[str, ...], field: str | int = 0):
        super().__init__()
        self.model, self.names, self.field = model, names, field

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args))) if self.names else self.model(*args)
        if isinstance(self.field, str):
            return getattr(out, self.field)
        return out[self.field]


def _no_dropout(model: nn.Module) -> nn.Module:
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model


def _zero_dropouts(kwargs: dict, cls) -> dict:
    """`kwargs` with every dropout probability of the config class set to zero."""
    defaults = cls().to_dict()
    zeros = {k: 0.0 for k, v in defaults.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float)}
    return {**zeros, **kwargs}


def _config(cls_name: str, attention: str = "sdpa", **kwargs):
    transformers = importlib.import_module("transformers")
    cls = getattr(transformers, cls_name)
    return cls(**_zero_dropouts(kwargs, cls), use_cache=False, attn_implementation=attention)


def _heads(width: int) -> int:
    return max(2, width // 64) if width >= 128 else 2


def _decoder_kwargs(family: str, layers: int, width: int, vocab: int, seq: int) -> dict:
    """A config of `family` with `layers` blocks of `width`: GQA with a quarter of the heads as key/value
    heads where the family has them, MLPs of about 2.7 × width (gated) or 4 × width."""
    heads = _heads(width)
    kv = max(1, heads // 4)
    common = {"vocab_size": vocab, "hidden_size": width, "num_hidden_layers": layers, "num_attention_heads": heads}
    positions = {"max_position_embeddings": max(2048, seq)}
    gated = dict(intermediate_size=width * 8 // 3 // 16 * 16, num_key_value_heads=kv, **positions)
    if family in ("Llama", "Qwen2", "Mistral"):
        return {**common, **gated}
    if family == "Gemma":
        return {**common, **gated, "head_dim": width // heads}
    # Experts as a loop over experts ("eager"): the grouped_mm form has no float64 kernel, so no reference.
    if family == "Mixtral":
        return {**common, **gated, "num_local_experts": 8, "num_experts_per_tok": 2, "experts_implementation": "eager"}
    if family == "Qwen2Moe":
        moe = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": width // 2}
        moe.update(experts_implementation="eager")
        return {**common, **gated, **moe, "shared_expert_intermediate_size": width * 2}
    if family == "GPT2":
        return {
            "vocab_size": vocab,
            "n_embd": width,
            "n_layer": layers,
            "n_head": heads,
            "n_positions": max(1024, seq),
            "bos_token_id": 0,
            "eos_token_id": 0,
        }
    if family == "GPTNeoX":
        return {**common, "intermediate_size": 4 * width, **positions}
    if family == "OPT":
        return dict(
            vocab_size=vocab,
            hidden_size=width,
            word_embed_proj_dim=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            ffn_dim=4 * width,
            **positions,
        )
    if family == "Falcon":
        return {**common, "new_decoder_architecture": False, "multi_query": True, "alibi": False}
    if family == "Phi":
        return {**common, "intermediate_size": 4 * width, **positions}
    raise ValueError(f"unknown decoder family {family!r}")


def _ids(batch: int, seq: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), device=device)


def _cast(m: nn.Module, device, dtype: str) -> nn.Module:
    return _no_dropout(m).to(device=device, dtype=torch.float32 if dtype == "f32" else torch.bfloat16)


def _decoder(family: str, model_cls: str, dtype: str = "bf16"):
    def build(size, device):
        batch, seq, layers, width, vocab = size
        cfg = _config(f"{family}Config", **_decoder_kwargs(family, layers, width, vocab, seq))
        model = getattr(importlib.import_module("transformers"), model_cls)(cfg)
        m = _cast(_Field(model, ("input_ids",), "logits"), device, dtype)
        return Built(m, (_ids(batch, seq, vocab, device),))

    return build


def _encoder_kwargs(family: str, layers: int, width: int, vocab: int, seq: int) -> dict:
    return dict(
        vocab_size=vocab,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=_heads(width),
        intermediate_size=4 * width,
        max_position_embeddings=max(512, seq + 2),
        **({"max_relative_positions": -1, "relative_attention": True} if family == "DebertaV2" else {}),
    )


def _encoder(family: str, dtype: str = "bf16"):
    def build(size, device):
        batch, seq, layers, width, vocab = size
        # DeBERTa's disentangled attention has no SDPA form in transformers.
        attention = "eager" if family == "DebertaV2" else "sdpa"
        cfg = _config(f"{family}Config", attention, **_encoder_kwargs(family, layers, width, vocab, seq))
        model = getattr(importlib.import_module("transformers"), f"{family}Model")(cfg)
        m = _cast(_Field(model, ("input_ids",), "last_hidden_state"), device, dtype)
        return Built(m, (_ids(batch, seq, vocab, device),))

    return build


def _t5(size, device, dtype: str = "bf16"):
    batch, seq, layers, width, vocab = size
    heads = _heads(width)
    cfg = _config(
        "T5Config",
        vocab_size=vocab,
        d_model=width,
        d_kv=width // heads,
        d_ff=4 * width,
        num_layers=layers,
        num_heads=heads,
        decoder_start_token_id=0,
    )
    model = importlib.import_module("transformers").T5ForConditionalGeneration(cfg)
    m = _cast(_Field(model, ("input_ids", "decoder_input_ids"), "logits"), device, dtype)
    return Built(m, (_ids(batch, seq, vocab, device), _ids(batch, seq // 4, vocab, device)))


def encoder_decoder_dims(layers: int, width: int, decoder_layers: int | None = None) -> dict:
    """The width, depth, heads and MLP sizes of a BART- or Whisper-style config: `layers` blocks of
    `width` in the encoder (and the decoder, unless `decoder_layers`), MLPs of 4 × width."""
    heads = _heads(width)
    return {
        "d_model": width,
        "encoder_layers": layers,
        "decoder_layers": layers if decoder_layers is None else decoder_layers,
        "encoder_attention_heads": heads,
        "decoder_attention_heads": heads,
        "encoder_ffn_dim": 4 * width,
        "decoder_ffn_dim": 4 * width,
    }


def _bart(size, device):
    batch, seq, layers, width, vocab = size
    cfg = _config(
        "BartConfig", vocab_size=vocab, max_position_embeddings=max(1024, seq), **encoder_decoder_dims(layers, width)
    )
    model = importlib.import_module("transformers").BartForConditionalGeneration(cfg)
    m = _cast(_Field(model, ("input_ids", "decoder_input_ids"), "logits"), device, "bf16")
    return Built(m, (_ids(batch, seq, vocab, device), _ids(batch, seq // 4, vocab, device)))


def _whisper(size, device):
    """Whisper on `seq` mel frames (the encoder halves them), decoding a quarter as many tokens."""
    batch, seq, layers, width, vocab = size
    mels = 80
    cfg = _config(
        "WhisperConfig",
        vocab_size=vocab,
        num_mel_bins=mels,
        **encoder_decoder_dims(layers, width),
        max_source_positions=seq // 2,
        max_target_positions=max(448, seq),
        decoder_start_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
    )
    model = importlib.import_module("transformers").WhisperForConditionalGeneration(cfg)
    m = _cast(_Field(model, ("input_features", "decoder_input_ids"), "logits"), device, "bf16")
    features = torch.randn(batch, mels, seq, device=device, dtype=torch.bfloat16)
    return Built(m, (features, _ids(batch, seq // 4, vocab, device)))


def _hf_vision(family: str):
    """transformers' ViT, ResNet and ConvNeXt from their configs, under bf16 autocast."""

    def build(size, device):
        batch, res = size
        small = res < 128
        if family == "ViT":
            width = 192 if small else 768
            kwargs = {"image_size": res, "patch_size": 8 if small else 16, "hidden_size": width}
            kwargs.update(num_hidden_layers=2 if small else 12, num_attention_heads=width // 64)
            kwargs.update(intermediate_size=4 * width)
        elif family == "ResNet":
            kwargs = {"layer_type": "bottleneck", "depths": [1, 1, 1, 1] if small else [3, 4, 6, 3]}
            kwargs.update(hidden_sizes=[64, 128, 256, 512] if small else [256, 512, 1024, 2048])
        else:
            kwargs = {"depths": [1, 1, 1, 1] if small else [3, 3, 9, 3]}
            kwargs.update(hidden_sizes=[32, 64, 128, 256] if small else [96, 192, 384, 768])
        transformers = importlib.import_module("transformers")
        cls = getattr(transformers, f"{family}Config")
        extra = {"attn_implementation": "sdpa"} if family == "ViT" else {}
        model = getattr(transformers, f"{family}Model")(cls(**_zero_dropouts(kwargs, cls), **extra))
        field = "last_hidden_state" if family == "ViT" else "pooler_output"
        m = _no_dropout(_Field(model, ("pixel_values",), field)).to(device)
        x = torch.randn(batch, 3, res, res, device=device)
        return Built(m, (x,), autocast=torch.bfloat16)

    return build


def _timm(name: str, dtype: str = "bf16 autocast"):
    """A timm model, `pretrained=False`, channels_last, under bf16 autocast (or float32)."""

    def build(size, device):
        timm = importlib.import_module("timm")
        batch, res = size
        kwargs = {"img_size": res} if name.startswith(("vit", "swin")) else {}
        m = timm.create_model(name, pretrained=False, num_classes=1000, **kwargs)
        m = _no_dropout(m).to(device=device, memory_format=torch.channels_last)
        x = torch.randn(batch, 3, res, res, device=device).contiguous(memory_format=torch.channels_last)
        return Built(m, (x,), autocast=torch.bfloat16 if dtype != "f32" else None)

    return build


class _Detections(nn.Module):
    """A torchvision detector in inference: the first image's boxes and scores, as one tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, images):
        (det, *_) = self.model(list(images))
        return torch.cat([det["boxes"], det["scores"][:, None]], dim=1)


def _detection(size, device):
    tvm = importlib.import_module("torchvision.models.detection")
    batch, res = size
    m = tvm.fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None, min_size=res, max_size=res)
    return Built(_Detections(m).to(device), (torch.rand(batch, 3, res, res, device=device),))


def _gcn(size, device):
    """torch_geometric's GCN over a random graph of `nodes` nodes and `edges` edges."""
    models = importlib.import_module("torch_geometric.nn.models")
    nodes, edges, features, layers = size
    m = models.GCN(features, features, layers, out_channels=16, dropout=0.0).to(device)
    x = torch.randn(nodes, features, device=device)
    edge_index = torch.randint(0, nodes, (2, edges), device=device)
    return Built(_Field(m, ()), (x, edge_index))


class _First(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)[0]


def _wav2vec2(size, device):
    """torchaudio's wav2vec2 base (12 layers at "gpu" scale) on `seconds` of 16 kHz audio."""
    tam = importlib.import_module("torchaudio.models")
    batch, samples, layers = size
    zero = {"encoder_projection_dropout": 0.0, "encoder_attention_dropout": 0.0, "encoder_ff_interm_dropout": 0.0}
    zero.update(encoder_dropout=0.0, encoder_layer_drop=0.0)
    m = tam.wav2vec2_base(**zero)
    m.encoder.transformer.layers = m.encoder.transformer.layers[:layers]
    return Built(_First(_no_dropout(m)).to(device), (torch.randn(batch, samples, device=device),), torch.bfloat16)


def describe_lm(size) -> str:
    return "{2} layers × {3}, {0}×{1} tokens".format(*size)


def describe_image(size) -> str:
    return "batch {}, {}²".format(*size)


BOTH = ("inference", "train")
_DECODERS = (
    ("llama", "Llama", "LlamaForCausalLM"),
    ("qwen2", "Qwen2", "Qwen2ForCausalLM"),
    ("mistral", "Mistral", "MistralForCausalLM"),
    ("gpt2", "GPT2", "GPT2LMHeadModel"),
    ("gpt_neox", "GPTNeoX", "GPTNeoXForCausalLM"),
    ("opt", "OPT", "OPTForCausalLM"),
    ("falcon", "Falcon", "FalconForCausalLM"),
    ("phi", "Phi", "PhiForCausalLM"),
    ("gemma", "Gemma", "GemmaForCausalLM"),
    ("mixtral", "Mixtral", "MixtralForCausalLM"),
    ("qwen2_moe", "Qwen2Moe", "Qwen2MoeForCausalLM"),
)
_TIMM = (
    "resnet50",
    "convnext_tiny",
    "efficientnet_b0",
    "mobilenetv3_large_100",
    "vit_base_patch16_224",
    "swin_tiny_patch4_window7_224",
    "regnety_016",
)


def workloads(workload: Callable) -> list:
    """The zoo's workloads, made by `workload(name, group, dtype, sizes, build, modes=, requires=, describe=)`
    (the bench's `Workload`)."""
    out = []

    def add(name, dtype, sizes, build, modes=BOTH, requires="transformers", describe=describe_lm):
        out.append(workload(f"zoo_{name}", "zoo", dtype, sizes, build, modes, requires, describe))

    for name, family, cls in _DECODERS:
        add(name, "bf16", LM, _decoder(family, cls))
    add("llama_f32", "f32", LM, _decoder("Llama", "LlamaForCausalLM", "f32"))
    encoder_lm = {"gpu": (32, 512, 12, 768, 30522), "cpu": (2, 128, 2, 256, 4096), "tiny": (1, 16, 1, 32, 128)}
    for name, family in (("bert", "Bert"), ("roberta", "Roberta"), ("deberta_v2", "DebertaV2")):
        add(name, "bf16", encoder_lm, _encoder(family))
    add("bert_f32", "f32", encoder_lm, _encoder("Bert", "f32"))
    seq2seq = {"gpu": (16, 512, 6, 768, 32128), "cpu": (1, 128, 2, 256, 4096), "tiny": (1, 16, 1, 32, 128)}
    add("t5", "bf16", seq2seq, _t5)
    add("bart", "bf16", seq2seq, _bart)
    whisper = {"gpu": (16, 3000, 4, 768, 51865), "cpu": (1, 200, 2, 256, 4096), "tiny": (1, 16, 1, 32, 128)}
    add(
        "whisper",
        "bf16",
        whisper,
        _whisper,
        describe=lambda s: "{2} layers × {3}, batch {0}, {1} mel frames".format(*s),
    )
    for family in ("ViT", "ResNet", "ConvNext"):
        add(f"hf_{family.lower()}", "bf16 autocast", VISION, _hf_vision(family), describe=describe_image)
    for name in _TIMM:
        add(name, "bf16 autocast", VISION, _timm(name), requires="timm", describe=describe_image)
    add("resnet50_f32", "f32", VISION, _timm("resnet50", "f32"), requires="timm", describe=describe_image)
    add(
        "fasterrcnn_mobilenet_v3",
        "f32",
        {"gpu": (8, 512), "cpu": (1, 224), "tiny": (1, 64)},
        _detection,
        modes=("inference",),
        requires="torchvision",
        describe=describe_image,
    )
    add(
        "gcn",
        "f32",
        {"gpu": (100_000, 1_000_000, 128, 3), "cpu": (10_000, 50_000, 64, 2), "tiny": (64, 256, 16, 2)},
        _gcn,
        requires="torch_geometric",
        describe=lambda s: "{} nodes, {} edges, {} features, {} layers".format(*s),
    )
    add(
        "wav2vec2",
        "bf16 autocast",
        {"gpu": (16, 16000 * 10, 12), "cpu": (1, 16000, 2), "tiny": (1, 1600, 1)},
        _wav2vec2,
        requires="torchaudio",
        describe=lambda s: "{2} layers, batch {0}, {1} samples".format(*s),
    )
    return out
