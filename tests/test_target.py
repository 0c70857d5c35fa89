"""The Target record (ember/target.py): heuristics as data, changed by `dataclasses.replace` or
the scoped setting `heuristics`, and a key that holds what a schedule depends on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import ember
from ember import config
from ember.backends.cpp import CppBackend
from ember.backends.triton import TritonBackend
from ember.target import Heuristics, LowerHeuristics, Target, Tile
from tests.helpers import assert_close, explain_strict


def test_heuristics_change_by_name():
    h = Heuristics().tuned(" split.max_second_split=8 , launch.column_one_sum=32x16x8,pad.products=1")
    assert h.split.max_second_split == 8 and h.launch.column_one_sum == Tile(32, 16, 8) and h.pad.products
    assert h.split.min_chunk == Heuristics().split.min_chunk  # the rest as they were
    assert Heuristics().tuned("") == Heuristics()
    # 0 where a field's default is 0 (its "off"), whatever a target sets: the C++ target's 32 channels
    cpp = Heuristics(lower=LowerHeuristics(product_convolutions_min_channels=32))
    assert cpp.tuned("lower.product_convolutions_min_channels=0").lower.product_convolutions_min_channels == 0


@pytest.mark.parametrize(
    "text,says",
    [
        ("max_second_split=8", "is not group.field=value"),
        ("spilt.min_chunk=8", "group one of split, launch"),
        ("split.min_chnuk=8", "split has no heuristic 'min_chnuk' (valid: max_outputs,"),
        ("split.min_chunk", "is not group.field=value"),
        ("split.min_chunk=eight", "is not a positive integer"),
        ("split.min_chunk=0", "is not a positive integer"),
        ("horizontal.table_min_parts=-1", "is not 0 or a positive integer"),
        ("launch.looped_row=1x2048", "is not a tile XBLOCKxRBLOCKxWARPS"),
        ("launch.looped_row=1x2000x8", "of powers of two"),
        ("pad.products=yes", "is not 0 or 1"),
    ],
)
def test_a_bad_change_says_what_is_wrong(text, says):
    with pytest.raises(ValueError) as e:
        Heuristics().tuned(text)
    assert says in str(e.value), str(e.value)
    # Through the setting: a ConfigError at once, naming the setting, and nothing changed.
    with pytest.raises(config.ConfigError) as e, config.override(heuristics=text):
        pass
    assert "heuristics=" in str(e.value) and says in str(e.value), str(e.value)
    assert config.get("heuristics") == ""


def test_the_setting_reaches_both_backends_targets(monkeypatch):
    with config.override(heuristics="split.partials=1024"):
        assert CppBackend().target().heuristics.split.partials == 1024
        assert TritonBackend().target().heuristics.split.partials == 1024
    monkeypatch.setenv("EMBER_HEURISTICS", "split.partials=one")
    with pytest.raises(config.ConfigError, match="EMBER_HEURISTICS"):
        config.check_environment()


def test_the_key_holds_what_a_schedule_depends_on():
    target = Target("triton", "cuda", "NVIDIA H100", False, 132, ("cuda", 90, 32), 3e12, 67e12, 4e-6, True, 132)
    # The measured bandwidth and the display name vary from run to run and change no schedule; the
    # FLOP rate and launch cost (fixed figures) decide which broadcast values are computed once.
    for same in ({"bandwidth": 1.0}, {"device_name": "another"}):
        assert dataclasses.replace(target, **same).key() == target.key(), same
    others = (
        {"sm_count": 114},
        {"row_programs": 0},
        {"online_softmax": False},
        {"indexed_rows": True},
        {"arch": ("cuda", 80, 32)},
    )
    for other in (*others, {"flop_rate": 2.0}, {"launch_seconds": 3.0}):
        assert dataclasses.replace(target, **other).key() != target.key(), other
    assert target.tuned("split.max_second_split=8").key() != target.key()
    assert hash(target) == hash(dataclasses.replace(target))  # frozen: usable as a dict key


def _column_sums(x):
    return x.sum(dim=0) * 2


def test_a_heuristic_changes_the_schedule_and_enters_its_key(tmp_path):
    """A reduction over 16384 rows into 16 outputs splits into two stages by default; with
    split.max_outputs=16 it stays one. The setting enters the schedule's key: each compile with
    it is scheduled, not served the other's cached schedule, and both equal eager."""
    x = torch.randn(16384, 16)
    want = _column_sums(x)

    def compile_with(**options):
        torch._dynamo.reset()
        report = explain_strict(_column_sums, x, backend="cpp", cache_dir=str(tmp_path), aot_cache=False, **options)
        (graph,) = report.graphs
        return graph

    split = compile_with()
    whole = compile_with(heuristics="split.max_outputs=16")
    again = compile_with(heuristics="split.max_outputs=16")
    assert "schedule" in split.stage_seconds and "schedule" in whole.stage_seconds
    assert "cached schedule" in again.stage_seconds  # the same heuristics: loaded
    assert len(split.kernels) == 2 and len(whole.kernels) == len(again.kernels) == 1, (split, whole)
    with ember.config.override(backend="cpp", strict=True, heuristics="split.max_outputs=16"):
        got = torch.compile(_column_sums, backend="ember")(x)
    assert_close(got, want, rtol=1e-4, atol=1e-4, what="column sums", line="repro: x.sum(0) * 2, [16384, 16]")
