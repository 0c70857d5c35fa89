"""DiskCache in isolation: atomic entries with checksums; anything not intact is a miss."""

from __future__ import annotations

import json
import os
import stat

import pytest

from ember import config
from ember.runtime.cache import MANIFEST, DiskCache, content_key


@pytest.fixture
def cache(tmp_path):
    return DiskCache(tmp_path / "c")


def test_put_then_get(cache):
    entry = cache.put("cpp", "ab" * 32, {"graph.cpp": b"int x;", "graph.so": b"\x7fELF..."})
    assert cache.get("cpp", "ab" * 32) == entry
    assert (entry / "graph.so").read_bytes() == b"\x7fELF..."
    assert entry == cache.entry("cpp", "ab" * 32) and entry.parent.name == "ab"
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700
    assert not [p for p in entry.parent.iterdir() if p.name.startswith(".tmp-")], "temporary directory left behind"


def test_missing_key_is_a_miss(cache):
    assert cache.get("cpp", "cd" * 32) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file", "delete_manifest", "bad_manifest"])
def test_damaged_entry_is_a_miss(cache, damage):
    key = "ef" * 32
    entry = cache.put("cpp", key, {"graph.so": b"0123456789" * 10})
    so = entry / "graph.so"
    if damage == "truncate":
        so.write_bytes(so.read_bytes()[:50])
    elif damage == "flip":
        so.write_bytes(b"X" + so.read_bytes()[1:])
    elif damage == "delete_file":
        so.unlink()
    elif damage == "delete_manifest":
        (entry / MANIFEST).unlink()
    else:
        (entry / MANIFEST).write_text("{not json")
    assert cache.get("cpp", key) is None, f"a {damage}d entry was trusted"


def test_put_replaces_a_corrupt_entry(cache):
    key = "12" * 32
    entry = cache.put("cpp", key, {"graph.so": b"good"})
    (entry / "graph.so").write_bytes(b"bad!")
    again = cache.put("cpp", key, {"graph.so": b"good"})
    assert cache.get("cpp", key) == again
    assert (again / "graph.so").read_bytes() == b"good"


def test_put_keeps_an_intact_entry(cache):
    """Two writers of one key: the entry already there (and intact) wins; nothing breaks."""
    key = "34" * 32
    cache.put("cpp", key, {"graph.so": b"first"})
    entry = cache.put("cpp", key, {"graph.so": b"first"})
    assert (entry / "graph.so").read_bytes() == b"first"
    assert json.loads((entry / MANIFEST).read_text()).keys() == {"graph.so"}


def test_cache_setting_off_makes_every_get_a_miss(cache):
    key = "56" * 32
    cache.put("cpp", key, {"graph.so": b"x"})
    with config.override(cache=False):
        assert cache.get("cpp", key) is None
    assert cache.get("cpp", key) is not None


def test_root_permissions_are_tightened(tmp_path):
    root = tmp_path / "shared"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    DiskCache(root).put("cpp", "78" * 32, {"a": b"b"})
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


def test_default_root_is_the_configured_cache_dir(tmp_path):
    with config.override(cache_dir=str(tmp_path / "elsewhere")):
        assert DiskCache().root == tmp_path / "elsewhere"


def test_content_key_is_stable_and_sensitive():
    k = content_key("cpp", "source", ("g++ 13",), ["-O3"])
    assert k == content_key("cpp", "source", ("g++ 13",), ["-O3"])
    assert len(k) == 64 and int(k, 16) >= 0
    assert k != content_key("cpp", "source ", ("g++ 13",), ["-O3"])
    assert k != content_key("cpp", "source", ("g++ 14",), ["-O3"])
    # Part boundaries matter: ("ab", "c") and ("a", "bc") are different keys.
    assert content_key("ab", "c") != content_key("a", "bc")


def test_test_session_does_not_use_the_home_cache(session_cache_dir):
    assert config.get("cache_dir") == session_cache_dir
    assert not session_cache_dir.startswith(os.path.expanduser("~/.cache"))
