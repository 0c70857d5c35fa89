"""The Target record (ember/target.py): heuristics as data, changed by `dataclasses.replace` or
by name, and a key that holds what a schedule depends on."""

from __future__ import annotations

import dataclasses

import pytest

from ember.target import Heuristics, Target, Tile


def test_heuristics_change_by_name():
    h = Heuristics().tuned(" split.max_second_split=8 , launch.column_one_sum=32x16x8,")
    assert h.split.max_second_split == 8 and h.launch.column_one_sum == Tile(32, 16, 8)
    assert h.split.min_chunk == Heuristics().split.min_chunk  # the rest as they were
    assert Heuristics().tuned("") == Heuristics()


@pytest.mark.parametrize(
    "text,says",
    [
        ("max_second_split=8", "is not group.field=value"),
        ("spilt.min_chunk=8", "group one of split, launch"),
        ("split.min_chnuk=8", "split has no heuristic 'min_chnuk' (valid: max_outputs,"),
        ("split.min_chunk", "is not group.field=value"),
        ("split.min_chunk=eight", "is not a positive integer"),
        ("split.min_chunk=0", "is not a positive integer"),
        ("launch.looped_row=1x2048", "is not a tile XBLOCKxRBLOCKxWARPS"),
        ("launch.looped_row=1x2000x8", "of powers of two"),
    ],
)
def test_a_bad_change_says_what_is_wrong(text, says):
    with pytest.raises(ValueError) as e:
        Heuristics().tuned(text)
    assert says in str(e.value), str(e.value)


def test_the_key_holds_what_a_schedule_depends_on():
    target = Target("triton", "cuda", "NVIDIA H100", False, 132, ("cuda", 90, 32), 3e12, 67e12, 4e-6, True, 132)
    # Measured limits and the display name vary from run to run and change no schedule.
    for same in ({"bandwidth": 1.0}, {"flop_rate": 2.0}, {"launch_seconds": 3.0}, {"device_name": "another"}):
        assert dataclasses.replace(target, **same).key() == target.key(), same
    for other in ({"sm_count": 114}, {"row_programs": 0}, {"online_softmax": False}, {"arch": ("cuda", 80, 32)}):
        assert dataclasses.replace(target, **other).key() != target.key(), other
    assert target.tuned("split.max_second_split=8").key() != target.key()
    assert hash(target) == hash(dataclasses.replace(target))  # frozen: usable as a dict key
