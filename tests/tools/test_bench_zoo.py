"""The zoo's small configs at tiny scale on the CPU: each builds from its config, and ember's outputs (and, for
a few, a training step's gradients) pass the float64 rule next to eager. transformers must be installed: where
it is not, these tests fail naming it."""

from __future__ import annotations

import importlib

import pytest
import torch

from ember.tools.bench import accuracy, report
from ember.tools.bench.workloads import WORKLOADS, Case, select
from tests.helpers import repro

CPU = torch.device("cpu")
# Eight architectures: GQA + RoPE decoder, GPT-2, an encoder, an encoder-decoder with relative position
# buckets, a second GQA decoder, and three vision models (convolutions with batch norm, with layer norm,
# and a ViT). Mixture-of-experts configs compile one graph per expert and take too long for CI.
INFERENCE = ["llama", "gpt2", "bert", "t5", "qwen2", "hf_resnet", "hf_convnext", "hf_vit"]
TRAIN = ["llama", "t5"]


def _require(package: str) -> None:
    try:
        importlib.import_module(package)
    except ImportError as e:
        pytest.fail(f"the zoo's CI subset needs {package} (scripts/test.sh installs it): {e}")


def test_zoo_has_thirty_architectures_in_both_modes():
    zoo = [w for w in WORKLOADS.values() if w.group == "zoo"]
    assert len(zoo) >= 30, [w.name for w in zoo]
    keys = {c.key for c in select("zoo")}
    assert "zoo_mixtral/train" in keys and "zoo_whisper/inference" in keys, sorted(keys)
    assert not keys & {c.key for c in select("all")}, "the zoo is asked for by name, not part of all"
    for w in zoo:
        assert set(w.sizes) == {"gpu", "cpu", "tiny"}, w.name
        assert w.requires in ("transformers", "timm", "torchvision", "torch_geometric", "torchaudio"), w.name


@pytest.mark.parametrize(
    "name,mode", [(n, "inference") for n in INFERENCE] + [(n, "train") for n in TRAIN], ids=lambda v: str(v)
)
def test_zoo_model_passes_the_float64_rule(name, mode):
    _require(WORKLOADS[f"zoo_{name}"].requires)
    record = accuracy.run_case(Case(WORKLOADS[f"zoo_{name}"], mode), ["ember"], "tiny", CPU)
    assert "error" not in record and "skipped" not in record, record.get("error") or record.get("skipped")
    result = record["compilers"]["ember"]
    assert result["status"] == "pass", f"{accuracy.one_line(record)}  {repro(workload=f'zoo_{name}', mode=mode)}"
    assert result["tensors"] >= (1 if mode == "inference" else 10), result
    assert not result["fallbacks"], result["fallbacks"]


def test_summary_gives_geometric_mean_and_lowest_rows_per_mode():
    def case(name, mode, inductor, ember):
        comps = {"inductor": {"status": "ok", "ms": inductor}, "ember": {"status": "ok", "ms": ember}}
        return {"type": "case", "case": f"{name}/{mode}", "workload": name, "mode": mode, "compilers": comps}

    records = [{"type": "run", "compilers": ["inductor", "ember"], "device": "cpu"}]
    records += [case("a", "inference", 2.0, 1.0), case("b", "inference", 1.0, 2.0), case("c", "inference", 1.0, 1.0)]
    records += [case("a", "train", 3.0, 1.0), case("b", "train", 3.0, 1.0)]
    lines = report.summary(report.Run.of(records))
    assert len(lines) == 2, lines
    assert "inference: geometric mean 1.00× over 3 rows; lowest: b 0.50×, c 1.00×, a 2.00×" in lines[0], lines
    assert "train: geometric mean 3.00× over 2 rows" in lines[1], lines
