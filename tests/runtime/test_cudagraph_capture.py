"""The allocator's expandable segments around a capture (runtime/cudagraph_capture.py): on for the
capture only, a user's own choice left as it is, the setting off where the caller turns it off, and
the real allocator's settings string as torch keeps it."""

from __future__ import annotations

import pytest
import torch

from ember.runtime import cudagraph_capture as capture


class _Settings:
    """A stand-in for the allocator's settings string: what was set, in order."""

    def __init__(self, current: str = ""):
        self.current = current
        self.calls: list[str] = []

    def get(self) -> str:
        return self.current

    def put(self, value: str) -> None:
        self.calls.append(value)
        self.current = value


@pytest.fixture
def settings(monkeypatch):
    fake = _Settings()
    monkeypatch.setattr(capture, "_allocator_settings", lambda: (fake.get, fake.put))
    return fake


def test_on_for_the_capture_only(settings):
    with capture.expandable_segments(True) as on:
        assert on and settings.current == capture.EXPANDABLE
    assert settings.calls == [capture.EXPANDABLE, capture.PLAIN]


def test_the_users_other_options_are_set_with_it_and_back(settings):
    """torch's parser may reset the options a settings string leaves out: each string is set whole."""
    settings.current = "max_split_size_mb:128"
    with capture.expandable_segments(True):
        assert settings.current == f"max_split_size_mb:128,{capture.EXPANDABLE}"
    assert settings.current == f"max_split_size_mb:128,{capture.PLAIN}"


def test_without_torchs_reader_the_environment_says_the_users_choice(monkeypatch):
    monkeypatch.delattr(torch._C, "_accelerator_getAllocatorSettings", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    get, _ = capture._allocator_settings()
    assert get() == "expandable_segments:True"


def test_turned_back_off_when_the_capture_raises(settings):
    with pytest.raises(RuntimeError), capture.expandable_segments(True):
        raise RuntimeError("capture failed")
    assert settings.current == capture.PLAIN


def test_a_users_own_choice_is_left_as_it_is(settings):
    settings.current = "max_split_size_mb:128, expandable_segments:true"
    with capture.expandable_segments(True) as on:
        assert on
    assert settings.calls == [] and settings.current.endswith("expandable_segments:true")


def test_the_setting_off_touches_nothing(settings):
    with capture.expandable_segments(False) as on:
        assert not on
    assert settings.calls == []


def test_a_torch_without_the_calls_captures_as_before(monkeypatch):
    monkeypatch.setattr(capture, "_allocator_settings", lambda: None)
    with capture.expandable_segments(True) as on:
        assert not on


def test_captures_in_turn_leave_the_string_as_it_was(settings):
    """torch 2.13 reads back the string last set: the way back must not grow it capture after capture."""
    settings.current = "max_split_size_mb:128"
    for _ in range(3):
        with capture.expandable_segments(True):
            assert settings.current == f"max_split_size_mb:128,{capture.EXPANDABLE}"
    assert settings.current == f"max_split_size_mb:128,{capture.PLAIN}"


def test_overlapping_captures_keep_it_on_until_the_last_ends(settings):
    """Two threads' captures overlap: the second shares the first's setting, and only the last to end turns
    it off (the first turning it off would leave the other's capture on plain segments)."""
    first, second = capture.expandable_segments(True), capture.expandable_segments(True)
    assert first.__enter__() and second.__enter__()
    first.__exit__(None, None, None)
    assert settings.current == capture.EXPANDABLE
    second.__exit__(None, None, None)
    assert settings.current == capture.PLAIN and settings.calls == [capture.EXPANDABLE, capture.PLAIN]


def test_a_refused_string_captures_on_plain_segments(monkeypatch):
    def refuse(value: str) -> None:
        raise RuntimeError("unknown allocator option")

    monkeypatch.setattr(capture, "_allocator_settings", lambda: (lambda: "", refuse))
    with capture.expandable_segments(True) as on:
        assert not on
    with pytest.raises(ValueError) as raised, capture.expandable_segments(True):
        raise ValueError("the capture's own error")
    assert raised.value.__context__ is None  # not raised while handling the refusal


def test_torchs_own_settings_calls_set_it_and_back():
    """The calls ember uses exist in this torch; where it reads the string back (2.13), the capture's string
    and the one left after it are as set."""
    get_put = capture._allocator_settings()
    assert get_put is not None, "torch._C lacks the allocator-settings calls ember uses"
    get, put = get_put
    reads_back = hasattr(torch._C, "_accelerator_getAllocatorSettings")
    before = get()
    try:
        with capture.expandable_segments(True) as on:
            assert on
            if reads_back:
                assert capture.EXPANDABLE.lower() in get().replace(" ", "").lower()
        if reads_back:
            assert "expandable_segments:true" not in get().replace(" ", "").lower()
    finally:
        put(before or capture.PLAIN)
