"""What the disk cache must not trust: a symbolic link at any level, a folder or file of another
user's, a folder others can write, and a file replaced after it was checked. Each is a miss (or
not written), never a load; ember changes no permission of a folder it did not create; and a
graph still compiles, with one warning, where the whole cache is refused.

Another user is played by uid 12345: these tests run as root, which can give files away.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import stat
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

import ember
from ember.runtime.cache import DiskCache
from tests.helpers import assert_close, assert_no_fallback, reports

OTHER_UID = 12345
KEY = "ab" * 32
FILES = {"graph.so": b"\x7fELF the real one", "graph.cpp": b"int x;"}


def _give_away(path: Path) -> None:
    """Make `path` and everything below it another user's."""
    assert os.geteuid() == 0, "these tests play another user by giving files away, which needs root"
    for p in [path, *path.rglob("*")]:
        os.lchown(p, OTHER_UID, OTHER_UID)


def _ember_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("ember")]


def _program(x):
    return torch.softmax(x * 2, -1) + torch.tanh(x)


def _compile_and_run(x, root: Path, **settings):
    """Compile `_program` for `x` with the cache at `root`: (result, ember warnings, report)."""
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, reports() as report:
        warnings.simplefilter("always")
        with ember.config.override(backend="cpp", strict=False, cache_dir=str(root), **settings):
            out = torch.compile(_program, backend="ember")(x)
    return out, _ember_warnings(caught), report


def _snapshot(root: Path) -> dict[str, tuple]:
    return {
        str(p.relative_to(root)): (p.lstat().st_mode, p.lstat().st_uid, p.lstat().st_mtime_ns)
        for p in [root, *root.rglob("*")]
    }


# -- symbolic links ---------------------------------------------------------------------------


def test_symlinked_entry_is_a_miss(tmp_path):
    cache = DiskCache(tmp_path / "c")
    real = cache.put("cpp", "cd" * 32, FILES).path
    planted = cache.entry("cpp", KEY)
    planted.parent.mkdir(mode=0o700)
    planted.symlink_to(real)  # an intact entry of ours, reached through a link
    with pytest.warns(UserWarning, match="is a symbolic link"):
        assert cache.get("cpp", KEY) is None
    # A put replaces the link, without touching what it points to.
    assert cache.put("cpp", KEY, {"graph.so": b"mine"})["graph.so"] == b"mine"
    assert not planted.is_symlink() and cache.get("cpp", KEY)["graph.so"] == b"mine"
    assert cache.get("cpp", "cd" * 32)["graph.so"] == FILES["graph.so"]


@pytest.mark.parametrize("level", ["kind", "prefix", "file", "manifest"])
def test_symlinked_folder_or_file_below_the_root_is_a_miss(tmp_path, level):
    cache = DiskCache(tmp_path / "c")
    path = cache.put("cpp", KEY, FILES).path
    assert cache.get("cpp", KEY) is not None
    moved = {
        "kind": path.parent.parent,
        "prefix": path.parent,
        "file": path / "graph.so",
        "manifest": path / "manifest.json",
    }[level]
    elsewhere = tmp_path / f"real-{level}"
    moved.rename(elsewhere)
    moved.symlink_to(elsewhere)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("cpp", KEY) is None, f"an entry reached through a symlinked {level} was trusted"
    msgs = _ember_warnings(caught)
    assert len(msgs) == 1 and "symbolic link" in msgs[0] and "ember cache clear" in msgs[0], msgs


def test_symlinked_root_is_not_used_and_not_chmodded(tmp_path):
    target = tmp_path / "shared"
    target.mkdir()
    os.chmod(target, 0o1777)  # a sticky, world-writable folder, as /tmp is
    DiskCache(target / "inner").put("cpp", KEY, FILES)  # a real cache entry behind the link, but not reached
    link = tmp_path / "cache"
    link.symlink_to(target)
    before = _snapshot(target)
    cache = DiskCache(link)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("cpp", KEY) is None
        assert cache.put("cpp", KEY, FILES)["graph.so"] == FILES["graph.so"]
        assert not cache.usable() and cache.secret("aot-key") is None
    msgs = _ember_warnings(caught)
    assert len(msgs) == 1 and "symbolic link" in msgs[0] and str(link) in msgs[0], msgs
    assert _snapshot(target) == before, "ember wrote through, or changed the mode of, a linked root"
    assert stat.S_IMODE(target.stat().st_mode) == 0o1777


# -- owners and modes -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["other_users", "group_writable", "world_writable"])
def test_unsafe_root_is_refused_not_fixed(tmp_path, how):
    root = tmp_path / "cache"
    cache = DiskCache(root)
    cache.put("cpp", KEY, FILES)
    if how == "other_users":
        _give_away(root)
    else:
        os.chmod(root, 0o770 if how == "group_writable" else 0o777)
    before = _snapshot(root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get("cpp", KEY) is None, f"an entry in a root that is {how} was trusted"
        assert cache.put("cpp", "ef" * 32, FILES)["graph.so"] == FILES["graph.so"]
        assert not cache.usable() and cache.secret("aot-key") is None
        assert cache.get("cpp", KEY) is None
    msgs = _ember_warnings(caught)
    assert len(msgs) == 1 and str(root) in msgs[0] and "EMBER_CACHE_DIR" in msgs[0], msgs
    assert _snapshot(root) == before, "ember wrote into, or changed the mode of, a root it must not use"


@pytest.mark.parametrize("what", ["entry_folder", "library", "manifest", "kind_folder_writable"])
def test_foreign_or_open_item_below_the_root_is_a_miss(tmp_path, what):
    cache = DiskCache(tmp_path / "c")
    path = cache.put("cpp", KEY, FILES).path
    if what == "entry_folder":
        _give_away(path)
    elif what == "library":
        os.lchown(path / "graph.so", OTHER_UID, OTHER_UID)
    elif what == "manifest":
        os.lchown(path / "manifest.json", OTHER_UID, OTHER_UID)
    else:
        os.chmod(path.parent.parent, 0o777)
    with pytest.warns(UserWarning, match="belongs to uid 12345|writable by other users"):
        assert cache.get("cpp", KEY) is None, f"{what}: trusted"


def test_the_key_file_must_be_a_private_regular_file(tmp_path):
    cache = DiskCache(tmp_path / "c")
    key = cache.secret("aot-key")
    path = cache.root / "aot-key"
    os.chmod(path, 0o644)
    with pytest.warns(UserWarning, match="readable only by you"):
        assert cache.secret("aot-key") is None, "a key others can read was used"
    path.unlink()
    elsewhere = tmp_path / "planted-key"
    elsewhere.write_bytes(b"k" * 32)
    os.chmod(elsewhere, 0o600)
    path.symlink_to(elsewhere)
    assert cache.secret("aot-key") is None, "a linked key was used"
    path.unlink()
    assert cache.secret("aot-key") not in (None, key), "a new key is made where the old one is gone"


# -- end to end: a refused cache still compiles ------------------------------------------------


def test_foreign_cache_compiles_anyway_and_loads_nothing_from_it(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    x = torch.randn(8, 16)
    _compile_and_run(x, root)
    (entry,) = [p.parent for p in root.glob("cpp/*/*/graph.so")]
    planted = entry / "graph.so"
    os.replace(_evil_library(tmp_path, tmp_path / "ran"), planted)  # the attacker's code under the real key
    _give_away(root)
    before = _snapshot(root)
    out, msgs, report = _compile_and_run(x, root)
    assert_close(out, _program(x), rtol=1e-5, atol=1e-6, what="result", line="foreign cache")
    assert len(report.graphs) == 1
    assert_no_fallback(report, "a foreign cache must cost the cache, not the compile")
    assert len(msgs) == 1 and "belongs to uid 12345" in msgs[0], msgs
    assert not (tmp_path / "ran").exists(), "the planted library was loaded"
    assert _snapshot(root) == before, "ember wrote into another user's cache"


# -- a file replaced between the check and the load --------------------------------------------


def _evil_library(tmp_path: Path, marker: Path) -> Path:
    """A shared library that creates `marker` when it is loaded."""
    src = tmp_path / "evil.c"
    src.write_text(
        f'#include <stdio.h>\n__attribute__((constructor)) static void ran(void) {{ fclose(fopen("{marker}", "w")); }}\n'
    )
    out = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", str(src), "-o", str(out)], check=True, capture_output=True)
    return out


def test_library_swapped_after_the_check_is_not_loaded(tmp_path, monkeypatch):
    """The swap happens inside ctypes.CDLL, the last step before dlopen: whatever ember then loads
    must be the bytes that the cache checked, not what the entry's path now holds."""
    root = tmp_path / "cache"
    x = torch.randn(8, 16)
    _compile_and_run(x, root)
    (so,) = root.glob("cpp/*/*/graph.so")
    good = so.read_bytes()
    marker = tmp_path / "ran"
    evil = _evil_library(tmp_path, marker)
    real_cdll, loaded = ctypes.CDLL, []

    def swap_then_load(path, *args, **kwargs):
        if str(path).endswith("graph.so"):
            if evil.exists():
                os.replace(evil, so)  # into the checked entry, under its checked name
            loaded.append(Path(path).read_bytes())
        return real_cdll(path, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", swap_then_load)  # ctypes' own, which the backend calls
    out, _, report = _compile_and_run(x, root)
    assert not marker.exists(), "the library swapped in after the check was loaded"
    assert loaded == [good], "the loaded bytes are not those the cache checked"
    assert len(report.graphs) == 1
    assert_no_fallback(report, "swapped library")
    assert_close(out, _program(x), rtol=1e-5, atol=1e-6, what="result", line="swap after check")


class _Planted:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_schedule_swapped_after_the_check_is_not_unpickled(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    x = torch.randn(8, 16)
    monkeypatch.setenv("EMBER_AOT_CACHE", "0")  # ember's own schedule cache alone
    _compile_and_run(x, root)
    (pickled,) = root.glob("schedule/*/*/schedule.pickle")
    marker = tmp_path / "ran"
    planted = tmp_path / pickled.name
    planted.write_bytes(pickle.dumps(_Planted(marker)))
    with ember.config.override(fault_inject=f"cache_swap={planted}"):  # swapped in right after the check
        out, _, report = _compile_and_run(x, root)
    assert pickled.read_bytes() == planted.read_bytes(), "the planted pickle was not swapped in"
    assert not marker.exists(), "a pickle swapped in after the check was unpickled"
    assert [list(g.stage_seconds)[:2] for g in report.graphs] == [["backend", "cached schedule"]]
    assert_close(out, _program(x), rtol=1e-5, atol=1e-6, what="result", line="schedule swap after check")
