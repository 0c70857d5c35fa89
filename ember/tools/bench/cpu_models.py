"""CPU inference models: small configs of real architectures from HF transformers, in float32, the
programs people serve on CPUs (and the ones ONNX Runtime is picked for). Random weights, nothing
downloaded, dropout off. `--workloads cpu_models`, beside `--ember-modes default,freezing --peers
onnxruntime`, sets ember against Inductor (with and without freezing) and ONNX Runtime.

Language models: one sequence of 128 tokens; vision models: one 224² image (serving's batch); the
Whisper encoder: 10 s of audio (1000 mel frames). "tiny" shrinks each for tests.
"""

from __future__ import annotations

import functools
import importlib

import torch

from ember.tools.bench import zoo
from ember.tools.bench.built import Built

LM = {"cpu": (1, 128, 2, 256, 4096), "tiny": (1, 16, 1, 32, 128)}
IMAGE = {"cpu": (1, 224), "tiny": (2, 64)}  # tiny: batch norm in training needs more than one value
AUDIO = {"cpu": (1, 1000, 2, 256), "tiny": (1, 16, 1, 32)}


def _vision(family: str, model_cls: str, field: str, **kwargs):
    """transformers' `model_cls` from `{family}Config(**kwargs)` on one image of the scale's size."""

    def build(size, device):
        batch, res = size
        transformers = importlib.import_module("transformers")
        cls = getattr(transformers, f"{family}Config")
        extra = {"image_size": res} if "image_size" in cls().to_dict() else {}
        if family == "ViT":
            extra["attn_implementation"] = "sdpa"
        model = getattr(transformers, model_cls)(cls(**zoo._zero_dropouts({**extra, **kwargs}, cls)))
        m = zoo._no_dropout(zoo._Field(model, ("pixel_values",), field)).to(device)
        image = torch.randn(batch, 3, res, res, device=device)
        _batch_norms_at_scale(m, image)
        return Built(m, (image,))

    return build


def _batch_norms_at_scale(model: torch.nn.Module, *inputs) -> None:
    """Batch norms as a trained network has them: scale 1, shift 0, running statistics those of the
    inputs. transformers initializes their scales like weights (normal, std 0.02), so in inference
    each of EfficientNet's blocks shrinks its activations about 50-fold: the last blocks compute on
    subnormal floats, which Intel CPUs take microcode assists for (EfficientNet-B0 ran 10x slower for
    eager, ember and ONNX Runtime alike), a cost no trained model pays."""
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    modes = [(m, m.training) for m in model.modules()]
    for m in norms:
        m.reset_parameters()
        m.momentum = None  # the cumulative average: after one call, the call's own statistics
    model.train()
    with torch.no_grad():
        model(*inputs)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    for m, training in modes:
        m.training = training


def _whisper_encoder(size, device):
    """Whisper's encoder alone (what speech pipelines run per chunk) on `frames` mel frames."""
    batch, frames, layers, width = size
    dims = zoo.encoder_decoder_dims(layers, width, decoder_layers=1)
    cfg = zoo._config("WhisperConfig", num_mel_bins=80, max_source_positions=frames // 2, **dims)
    encoder = importlib.import_module("transformers").WhisperModel(cfg).get_encoder()
    m = zoo._no_dropout(zoo._Field(encoder, ("input_features",), "last_hidden_state")).to(device)
    return Built(m, (torch.randn(batch, 80, frames, device=device),))


MODELS = {
    "llama": (LM, zoo._decoder("Llama", "LlamaForCausalLM", "f32"), zoo.describe_lm),
    "t5": (LM, functools.partial(zoo._t5, dtype="f32"), zoo.describe_lm),
    "mixtral": (LM, zoo._decoder("Mixtral", "MixtralForCausalLM", "f32"), zoo.describe_lm),
    "bert": (LM, zoo._encoder("Bert", "f32"), zoo.describe_lm),
    "resnet": (
        IMAGE,
        _vision(
            "ResNet",
            "ResNetModel",
            "pooler_output",
            layer_type="basic",
            depths=[2, 2, 2, 2],
            hidden_sizes=[64, 128, 256, 512],
            embedding_size=64,
        ),
        zoo.describe_image,
    ),
    "convnext": (
        IMAGE,
        _vision("ConvNext", "ConvNextModel", "pooler_output", depths=[2, 2, 6, 2], hidden_sizes=[64, 128, 256, 512]),
        zoo.describe_image,
    ),
    "vit_small": (
        IMAGE,
        _vision(
            "ViT",
            "ViTModel",
            "last_hidden_state",
            patch_size=16,
            hidden_size=384,
            num_hidden_layers=6,
            num_attention_heads=6,
            intermediate_size=1536,
        ),
        zoo.describe_image,
    ),
    "mobilenet_v2": (IMAGE, _vision("MobileNetV2", "MobileNetV2Model", "pooler_output"), zoo.describe_image),
    "efficientnet_b0": (
        IMAGE,
        _vision(
            "EfficientNet",
            "EfficientNetModel",
            "pooler_output",
            width_coefficient=1.0,
            depth_coefficient=1.0,
            hidden_dim=1280,
        ),
        zoo.describe_image,
    ),
    "whisper_encoder": (AUDIO, _whisper_encoder, lambda s: "{2} layers × {3}, {1} mel frames".format(*s)),
}


def workloads(workload) -> list:
    """The group's workloads, made by the bench's `Workload(name, group, dtype, sizes, build, modes, requires,
    describe)`; the "gpu" scale runs the "cpu" sizes (these are CPU programs)."""
    return [
        workload(
            f"cpu_{name}",
            "cpu_models",
            "f32",
            {**sizes, "gpu": sizes["cpu"]},
            build,
            ("inference", "train"),
            "transformers",
            describe,
        )
        for name, (sizes, build, describe) in MODELS.items()
    ]
