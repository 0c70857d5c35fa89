"""Cache keys (runtime/cache.py: content_key): one recipe whose parts cannot run into each other, and
one list of the settings that enter keys, config.py's `codegen` marks."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ember import config
from ember.runtime import schedule_cache
from ember.runtime.cache import content_key, ember_identity

# A value other than the default that each setting accepts, where the generic rule below gives none.
_OTHER = {
    "logs": "cache",
    "heuristics": "split.max_second_split=8",
    "fault_inject": "patterns",
    "progress_after_s": 0.5,
}


def _other_value(setting: config.Setting):
    """A valid value of `setting` other than its default."""
    if setting.name in _OTHER:
        value = _OTHER[setting.name]
    elif setting.choices:
        value = next(c for c in setting.choices if c != setting.default)
    elif setting.type is bool:
        value = not setting.default
    elif setting.type in (int, float):
        value = setting.default + 1
    else:
        value = setting.default + "-other"
    try:
        return setting.parse(value, "test")
    except config.ConfigError as e:
        pytest.fail(f"{e}: name a valid value other than the default for {setting.name!r} in _OTHER")


# Pairs of (content, named parts) that a recipe joining the parts' bytes could not tell apart.
_DIFFERENT_PARTS = {
    "a separator inside a part": (((b"a\0", b"b"), {}), ((b"a", b"\0b"), {})),
    "text and bytes of one spelling": ((("x",), {}), ((b"x",), {})),
    "text and a value of the same repr": ((("1",), {}), ((1,), {})),
    "where one part ends": ((("ab", "c"), {}), (("a", "bc"), {})),
    "content or target": ((("a",), {"target": "b"}), (("a", "b"), {})),
    "target or toolchain": ((("a",), {"target": "t"}), (("a",), {"toolchain": "t"})),
    "with or without ember's identity": ((("a",), {"ember": True}), (("a",), {})),
}


@pytest.mark.parametrize(("one", "other"), list(_DIFFERENT_PARTS.values()), ids=list(_DIFFERENT_PARTS))
def test_different_parts_are_different_keys(one, other):
    (content, named), (other_content, other_named) = one, other
    key = content_key("kind", *content, **named)
    assert key == content_key("kind", *content, **named)
    assert key != content_key("kind", *other_content, **other_named)


def test_the_kind_enters_the_key():
    assert content_key("cpp", "source") != content_key("triton", "source")


@pytest.mark.parametrize("setting", list(config.SETTINGS.values()), ids=lambda s: s.name)
def test_ember_s_identity_holds_exactly_the_codegen_settings(setting):
    identity = ember_identity()
    with config.override(**{setting.name: _other_value(setting)}):
        changed = ember_identity() != identity
    assert changed == setting.codegen, f"{setting.name}: codegen={setting.codegen}, but the key changed={changed}"


def _graph() -> torch.fx.GraphModule:
    return make_fx(lambda x: torch.softmax(x * 2, -1))(torch.randn(4, 8))


@pytest.mark.parametrize("setting", list(config.SETTINGS.values()), ids=lambda s: s.name)
def test_a_schedule_key_changes_with_exactly_the_codegen_settings(setting, tmp_path):
    gm, target = _graph(), ("cpp", 0, 512)
    with config.override(cache_dir=str(tmp_path)):
        key = schedule_cache.schedule_key(gm, "inference", target)
        with config.override(**{setting.name: _other_value(setting)}):
            cacheable = schedule_cache.cacheable_settings()
            other = schedule_cache.schedule_key(gm, "inference", target)
    assert key is not None
    if not cacheable:  # the setting turns the schedule cache off
        assert other is None
    else:
        assert (other != key) == setting.codegen, setting.name


def test_a_schedule_key_holds_the_target(tmp_path):
    gm = _graph()
    with config.override(cache_dir=str(tmp_path)):
        assert schedule_cache.schedule_key(gm, "inference", ("cpp", 0, 512)) != schedule_cache.schedule_key(
            gm, "inference", ("cpp", 0, 513)
        )


def test_triton_identity_follows_what_steers_binaries_not_where_files_go(monkeypatch):
    """A cache imported where Triton keeps its files elsewhere (another TRITON_CACHE_DIR) must find
    its kernels and launch records; a variable that changes the binary still changes the key."""
    from ember.runtime.cache import triton_identity

    base = triton_identity()
    monkeypatch.setenv("TRITON_CACHE_DIR", "/somewhere/else")
    monkeypatch.setenv("TRITON_HOME", "/another/home")
    assert triton_identity() == base
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert triton_identity() != base
    steered = triton_identity()
    monkeypatch.setenv("PTXAS_OPTIONS", "-O1")  # no TRITON_ prefix, but it reaches ptxas
    assert triton_identity() != steered
