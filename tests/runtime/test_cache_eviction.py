"""The disk cache's size bound (setting `cache_max_mb`): past it, the least recently used entries
go, and processes that write, read and evict one cache at once never see part of an entry."""

from __future__ import annotations

import multiprocessing
import os
import time

from ember import config
from ember.runtime.cache import STALE_TMP_SECONDS, DiskCache

MIB = 1 << 20


def _files(i: int, size: int = 300 << 10) -> dict[str, bytes]:
    return {"graph.so": bytes([i % 256]) * size, "graph.cpp": f"entry {i}".encode()}


def _key(i: int) -> str:
    return f"{i:064x}"


def _size(root) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file() and p.name != "CACHEDIR.TAG")


def test_the_cache_stays_under_its_bound_and_keeps_what_was_used(tmp_path):
    cache = DiskCache(tmp_path / "c")
    with config.override(cache_max_mb=1):
        for i in range(3):  # 0.9 MiB: under the bound
            cache.put("cpp", _key(i), _files(i))
        assert all(cache.get("cpp", _key(i)) is not None for i in (1, 0, 2)), "evicted under the bound"
        assert cache.get("cpp", _key(0)) is not None  # used last: 1, 2, 0
        for i in range(3, 10):
            cache.put("cpp", _key(i), _files(i))
            assert _size(cache.root) <= MIB, f"{_size(cache.root)} bytes after {i + 1} entries"
        kept = [i for i in range(10) if cache.get("cpp", _key(i)) is not None]
    assert 9 in kept and 8 in kept, f"the newest entries were evicted: kept {kept}"
    assert 1 not in kept and 2 not in kept, f"older unused entries outlived newer ones: kept {kept}"
    assert not [p for p in cache.root.iterdir() if p.name.startswith(".trash-")], "evicted files left behind"


def test_a_recent_hit_outlives_older_ones(tmp_path):
    cache = DiskCache(tmp_path / "c")
    with config.override(cache_max_mb=1):
        for i in range(3):
            cache.put("cpp", _key(i), _files(i))
        assert cache.get("cpp", _key(0)) is not None  # 0 is now the most recently used
        cache.put("cpp", _key(3), _files(3))  # 1.2 MiB: one entry must go, and 1 was used least recently
        assert cache.get("cpp", _key(1)) is None
        assert all(cache.get("cpp", _key(i)) is not None for i in (0, 2, 3))


def test_no_bound_keeps_everything(tmp_path):
    cache = DiskCache(tmp_path / "c")
    with config.override(cache_max_mb=0):
        for i in range(5):
            cache.put("cpp", _key(i), _files(i))
        assert cache.trim() == []
        assert all(cache.get("cpp", _key(i)) is not None for i in range(5))


def _churn(root: str, worker: int, queue) -> None:
    """Write, read and evict 40 entries of 3 keys in a cache bounded to 1 MiB."""
    os.environ["EMBER_CACHE_MAX_MB"] = "1"
    cache = DiskCache(root)
    bad = []
    for step in range(40):
        i = (worker + step) % 3
        cache.put("cpp", _key(i), _files(i, 400 << 10))
        found = cache.get("cpp", _key((i + 1) % 3))
        if found is not None and dict(found.files) != _files((i + 1) % 3, 400 << 10):
            bad.append(step)
    queue.put(bad)


def test_eight_processes_writing_reading_and_evicting_at_once(tmp_path):
    root = str(tmp_path / "c")
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_churn, args=(root, w, queue)) for w in range(8)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"a process failed (exit {p.exitcode})"
    assert results == [[]] * 8, f"a get returned part of an entry: {results}"
    assert _size(tmp_path / "c") <= MIB, "over the bound once every process is done"
    cache = DiskCache(root)
    for i in range(3):
        found = cache.get("cpp", _key(i))
        assert found is None or dict(found.files) == _files(i, 400 << 10), f"entry {i} left damaged"
    assert not [p for p in (tmp_path / "c").rglob(".tmp-*")], "a temporary folder was left behind"
    assert not [p for p in (tmp_path / "c").iterdir() if p.name.startswith(".trash-")], "evicted files left behind"


def test_folders_left_by_dead_writers_are_swept_and_live_ones_kept(tmp_path):
    """A process killed while writing an entry leaves a .tmp-* folder, one killed while removing
    entries a .trash-* folder; the next size check removes those past their age, and no other."""
    cache = DiskCache(tmp_path / "c")
    path = cache.put("cpp", _key(1), _files(1, 10)).path
    dead_write, live_write = path.parent / ".tmp-dead", path.parent / ".tmp-live"
    dead_trash = cache.root / ".trash-dead"
    for folder in (dead_write, live_write, dead_trash):
        folder.mkdir()
        (folder / "graph.so").write_bytes(b"half")
    old = time.time() - STALE_TMP_SECONDS - 1
    for folder in (dead_write, dead_trash):
        os.utime(folder, (old, old))
    with config.override(cache_max_mb=1):
        cache.trim()
    assert not dead_write.exists() and not dead_trash.exists()
    assert live_write.exists(), "a write in progress was removed"
    assert cache.get("cpp", _key(1)) is not None
