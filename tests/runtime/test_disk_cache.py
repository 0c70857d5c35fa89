"""DiskCache in isolation: atomic entries with checksums; anything not intact is a miss; the
setting `cache` off reads and writes nothing. (test_cache_trust.py: folders and files the cache
must not trust; test_cache_eviction.py: its size bound.)"""

from __future__ import annotations

import json
import os
import stat

import pytest

from ember import config
from ember.runtime.cache import MANIFEST, MARKER, MARKER_TEXT, DiskCache, content_key


@pytest.fixture
def cache(tmp_path):
    return DiskCache(tmp_path / "c")


def test_put_then_get(cache):
    written = cache.put("cpp", "ab" * 32, {"graph.cpp": b"int x;", "graph.so": b"\x7fELF..."})
    found = cache.get("cpp", "ab" * 32)
    assert found is not None and found.path == written.path == cache.entry("cpp", "ab" * 32)
    assert dict(found.files) == {"graph.cpp": b"int x;", "graph.so": b"\x7fELF..."}
    assert (found.path / "graph.so").read_bytes() == b"\x7fELF..."
    assert found.path.parent.name == "ab"
    assert stat.S_IMODE(cache.root.stat().st_mode) == 0o700
    assert (cache.root / MARKER).read_bytes() == MARKER_TEXT, "a root ember made carries its marker"
    assert not [p for p in found.path.parent.iterdir() if p.name.startswith(".tmp-")], "temporary folder left"


def test_missing_key_is_a_miss(cache):
    assert cache.get("cpp", "cd" * 32) is None
    assert not cache.root.exists(), "a get created the cache folder"


def test_unknown_kind_or_odd_key_is_an_error(cache):
    with pytest.raises(ValueError, match="not a cache entry"):
        cache.get("nonsense", "ab" * 32)
    with pytest.raises(ValueError, match="not a cache entry"):
        cache.put("cpp", "../../etc", {"a": b"b"})


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_file", "delete_manifest", "bad_manifest", "extra"])
def test_damaged_entry_is_a_miss(cache, damage):
    key = "ef" * 32
    path = cache.put("cpp", key, {"graph.so": b"0123456789" * 10}).path
    so = path / "graph.so"
    if damage == "truncate":
        so.write_bytes(so.read_bytes()[:50])
    elif damage == "flip":
        so.write_bytes(b"X" + so.read_bytes()[1:])
    elif damage == "delete_file":
        so.unlink()
    elif damage == "delete_manifest":
        (path / MANIFEST).unlink()
    elif damage == "bad_manifest":
        (path / MANIFEST).write_text("{not json")
    else:
        (path / "planted.so").write_bytes(b"not in the manifest")
    assert cache.get("cpp", key) is None, f"a {damage} entry was trusted"


def test_put_replaces_a_corrupt_entry(cache):
    key = "12" * 32
    path = cache.put("cpp", key, {"graph.so": b"good"}).path
    (path / "graph.so").write_bytes(b"bad!")
    again = cache.put("cpp", key, {"graph.so": b"good"})
    assert again.path == path and again["graph.so"] == b"good"
    assert cache.get("cpp", key)["graph.so"] == b"good"
    assert (path / "graph.so").read_bytes() == b"good"
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".trash-")], "the damaged entry was left"


def test_put_keeps_an_intact_entry(cache):
    """Two writers of one key: the entry already there (and intact) wins; nothing breaks."""
    key = "34" * 32
    cache.put("cpp", key, {"graph.so": b"first"})
    entry = cache.put("cpp", key, {"graph.so": b"first"})
    assert entry["graph.so"] == b"first"
    assert json.loads((entry.path / MANIFEST).read_text()).keys() == {"graph.so"}


def test_cache_setting_off_reads_and_writes_nothing(cache):
    key = "56" * 32
    with config.override(cache=False):
        entry = cache.put("cpp", key, {"graph.so": b"x"})
        assert entry["graph.so"] == b"x", "put still hands back the files"
        assert not cache.root.exists(), "the cache setting is off, yet the cache folder was written"
        assert not cache.usable() and cache.secret("aot-key") is None
    assert not cache.root.exists()
    cache.put("cpp", key, {"graph.so": b"x"})
    with config.override(cache=False):
        assert cache.get("cpp", key) is None
    assert cache.get("cpp", key) is not None


def test_a_hit_stamps_its_use_and_changes_nothing_else(cache):
    key = "9a" * 32
    manifest = cache.put("cpp", key, {"graph.so": b"x"}).path / MANIFEST
    os.utime(manifest, ns=(1_000_000_000, 2_000_000_000))
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in cache.root.rglob("*")}
    assert cache.get("cpp", key) is not None
    assert manifest.stat().st_atime_ns > 1_000_000_000, "the hit was not recorded"
    assert {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in cache.root.rglob("*")} == before


def test_default_root_is_the_configured_cache_dir(tmp_path):
    with config.override(cache_dir=str(tmp_path / "elsewhere")):
        assert DiskCache().root == tmp_path / "elsewhere"


def test_secret_is_made_once_private_and_kept(cache):
    key = cache.secret("aot-key")
    assert key is not None and len(key) == 32
    assert cache.secret("aot-key") == key
    assert stat.S_IMODE((cache.root / "aot-key").stat().st_mode) == 0o600
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".tmp-")]
    with pytest.raises(ValueError, match="not one of ember's secrets"):
        cache.secret("../elsewhere")


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
