"""Faults around the compiler: a missing or failing C++ compiler, a damaged cache entry, a cache
folder that cannot be used or written, the cache turned off, two processes compiling one graph at
once. Each ends in the right answer: compiled, or run eagerly with one warning naming the cause;
a damaged binary is never loaded, and a cache that cannot be used costs the caching, not the compile.

(tests/test_fallback.py covers a nonexistent compiler set through options and strict mode;
tests/runtime/test_cache.py a truncated binary across processes; tests/runtime/test_disk_cache.py the
cache's own checks; tests/runtime/test_cache_trust.py foreign, linked and open cache folders.)
"""

from __future__ import annotations

import ctypes
import errno
import json
import multiprocessing
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch

import ember
from ember.runtime.cache import MANIFEST, DiskCache
from tests.helpers import assert_close, explain_strict, reports, repro


def _program(x):
    return torch.softmax(x * 2, -1) + torch.tanh(x)


def _ember_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("ember")]


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def _compile_and_run(x, report=None, **settings):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught, reports() as collected:
        warnings.simplefilter("always")
        with ember.config.override(backend="cpp", strict=False, **settings):
            out = torch.compile(_program, backend="ember")(x)
    if report is not None:
        report.extend(collected.graphs)
    return out, _ember_warnings(caught)


@pytest.fixture
def loaded_libraries(monkeypatch) -> list[bytes]:
    """The bytes of each compiled graph the C++ backend hands to ctypes.CDLL (not system libraries
    such as libmvec), read as it is loaded."""
    loaded: list[bytes] = []
    real = ctypes.CDLL

    def spy(path, *args, **kwargs):
        if str(path).endswith("graph.so"):
            loaded.append(Path(path).read_bytes())
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ctypes, "CDLL", spy)  # ctypes' own, which the backend calls
    return loaded


# -- the C++ compiler ------------------------------------------------------------------------

FAILING_COMPILERS = {
    # name: shell body. --version must work for some (toolchain identity), then the build fails.
    "exits_1": 'case "$1" in --version) echo "fake g++ 1.0";; *) echo "internal compiler error" >&2; exit 1;; esac',
    "no_output_file": 'case "$1" in --version) echo "fake g++ 1.0";; *) exit 0;; esac',
    "not_a_library": 'case "$1" in --version) echo "fake g++ 1.0";; *) while [ "$1" != "-o" ]; do shift; done; '
    'echo garbage > "$2";; esac',
    "version_fails": "exit 3",
}


@pytest.mark.parametrize("kind", list(FAILING_COMPILERS))
def test_failing_compiler_falls_back_with_a_warning(tmp_path, kind, loaded_libraries):
    cxx = _script(tmp_path, f"g++-{kind}", FAILING_COMPILERS[kind])
    x = torch.randn(8, 16)
    line = repro(cxx=kind, input=x)
    out, msgs = _compile_and_run(x, cxx=str(cxx), cache_dir=str(tmp_path / "cache"))
    assert_close(out, _program(x), rtol=1e-6, atol=1e-6, what="fallback result", line=line)
    assert len(msgs) == 1, f"expected one ember warning, got {msgs}\n{line}"
    assert not list((tmp_path / "cache").glob("cpp/*/*/graph.so")), f"a failed build left a cache entry\n{line}"
    assert not loaded_libraries or kind == "not_a_library", loaded_libraries


def test_missing_compiler_from_the_environment_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("EMBER_CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("EMBER_CACHE_DIR", str(tmp_path / "cache"))
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(_program, backend="ember", options={"backend": "cpp"})(x)
    assert_close(out, _program(x), rtol=1e-6, atol=1e-6, what="fallback result", line="EMBER_CXX=missing")
    msgs = _ember_warnings(caught)
    assert len(msgs) == 1 and "no-such-g++" in msgs[0], msgs


# -- a cache folder that cannot be used or written, or the cache off --------------------------


def test_cache_dir_that_is_a_file_still_compiles_naming_it(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    x = torch.randn(8, 16)
    graphs: list = []
    out, msgs = _compile_and_run(x, graphs, cache_dir=str(blocker))
    assert_close(out, _program(x), rtol=1e-5, atol=1e-6, what="result", line="cache_dir is a file")
    assert len(graphs) == 1 and not graphs[0].fallback, f"ran eagerly: {graphs[0].fallback}"
    assert len(msgs) == 1 and "not-a-dir" in msgs[0], msgs
    assert blocker.read_text() == "x"


def test_full_disk_costs_the_caching_not_the_compile(tmp_path, monkeypatch):
    """Every folder the cache would make fails as on a full disk; graphs still compile (not
    eagerly), with one warning, from this process's private folder."""
    root = tmp_path / "cache"
    real_mkdir = os.mkdir

    def full(path, *args, dir_fd=None, **kwargs):
        if dir_fd is not None or str(path).startswith(str(root)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        return real_mkdir(path, *args, dir_fd=dir_fd, **kwargs)

    monkeypatch.setattr(os, "mkdir", full)
    x = torch.randn(8, 16)
    graphs: list = []
    out, msgs = _compile_and_run(x, graphs, cache_dir=str(root))
    monkeypatch.undo()
    assert_close(out, _program(x), rtol=1e-5, atol=1e-6, what="result", line="full disk")
    assert len(graphs) == 1 and not graphs[0].fallback, f"ran eagerly: {graphs[0].fallback}"
    assert len(msgs) == 1 and "No space left" in msgs[0], msgs
    assert not root.exists()


@pytest.mark.parametrize("backend", ["cpp", "triton"])
def test_cache_off_writes_nothing_into_the_cache_folder(tmp_path, monkeypatch, backend):
    """EMBER_CACHE=0: no binary, kernel module, schedule or key lands in the cache folder, for an
    inference graph and a training step alike."""
    root = tmp_path / "cache"
    monkeypatch.setenv("EMBER_CACHE", "0")
    x = torch.randn(8, 16)
    inference = explain_strict(_program, x, backend=backend, cache_dir=str(root))
    training = explain_strict(_program, x.clone().requires_grad_(), backend=backend, cache_dir=str(root))
    assert [g.kind for g in inference.graphs + training.graphs] == ["inference", "forward", "backward"]
    assert not root.exists(), sorted(str(p) for p in root.rglob("*"))


# -- damaged and foreign cache entries ---------------------------------------------------------


def _the_entry(root: Path) -> Path:
    (entry,) = [p.parent for p in (root / "cpp").glob("*/*/manifest.json")]
    return entry


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@pytest.mark.parametrize("damage", ["flip_byte", "truncate", "manifest_omits_library", "empty_manifest"])
def test_damaged_entry_is_rebuilt_not_loaded(tmp_path, damage, loaded_libraries):
    root = tmp_path / "cache"
    x = torch.randn(8, 16)
    _compile_and_run(x, cache_dir=str(root))
    entry = _the_entry(root)
    so = entry / "graph.so"
    good = so.read_bytes()
    manifest = json.loads((entry / MANIFEST).read_text())
    # Damage by replacing files, never writing into them: this process has the library mapped.
    if damage == "flip_byte":
        _replace(so, good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    elif damage == "truncate":
        _replace(so, good[: len(good) // 3])
    elif damage == "manifest_omits_library":
        _replace(so, b"planted")  # a library the manifest does not vouch for
        _replace(entry / MANIFEST, json.dumps({k: v for k, v in manifest.items() if k != "graph.so"}).encode())
    else:
        _replace(so, b"planted")
        _replace(entry / MANIFEST, b"{}")
    loaded_libraries.clear()
    out, msgs = _compile_and_run(x, cache_dir=str(root))
    line = repro(damage=damage)
    assert not msgs, f"a damaged entry should be rebuilt, not fall back: {msgs}\n{line}"
    assert_close(out, _program(x), rtol=1e-5, atol=1e-6, what="result", line=line)
    assert so.read_bytes() == good, f"the damaged entry was not replaced by a rebuild\n{line}"
    assert loaded_libraries == [good], "not loaded once, as rebuilt"


def test_cache_root_is_private(tmp_path):
    root = tmp_path / "fresh" / "cache"
    x = torch.randn(8, 16)
    _compile_and_run(x, cache_dir=str(root))
    assert stat.S_IMODE(root.stat().st_mode) == 0o700, oct(root.stat().st_mode)


# -- two processes at once -------------------------------------------------------------------


def _compile_in_child(cache_dir: str, barrier, queue) -> None:
    os.environ["EMBER_CACHE_DIR"] = cache_dir
    x = torch.linspace(-3, 3, 64 * 33).reshape(64, 33)
    barrier.wait()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(_program, backend="ember", options={"backend": "cpp", "strict": True})(x)
    ok = torch.allclose(out, _program(x), rtol=1e-5, atol=1e-6)
    queue.put((ok, _ember_warnings(caught)))


def test_two_processes_compile_the_same_graph_at_once(tmp_path):
    cache_dir = str(tmp_path / "cache")
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_compile_in_child, args=(cache_dir, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0, f"a compiling process failed (exit {p.exitcode})"
    assert all(ok for ok, _ in results), results
    assert all(not msgs for _, msgs in results), results
    entries = list(Path(cache_dir, "cpp").glob("*/*/manifest.json"))
    assert len(entries) == 1, entries
    assert DiskCache(cache_dir).get("cpp", entries[0].parent.name) is not None, "the entry left behind is damaged"
    assert not list(Path(cache_dir, "cpp").glob("*/.tmp-*")), "a temporary directory was left behind"
