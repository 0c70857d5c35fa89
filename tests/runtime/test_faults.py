"""Faults around the compiler: a missing or failing C++ compiler, a damaged or foreign cache
entry, two processes compiling one graph at once. Each ends in the right answer: compiled,
or run eagerly with one warning naming the cause; a damaged or foreign binary is never loaded.

(tests/test_fallback.py covers a nonexistent compiler set through options and strict mode;
tests/test_cache.py a truncated binary across processes; tests/runtime/test_disk_cache.py the
cache's own checks.)
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing
import os
import stat
import warnings
from pathlib import Path

import pytest
import torch

import ember
from ember.backends import cpp as cpp_backend
from ember.runtime import cache as cache_module
from ember.runtime.cache import MANIFEST, DiskCache
from tests.helpers import assert_close, repro


def _program(x):
    return torch.softmax(x * 2, -1) + torch.tanh(x)


def _ember_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("ember")]


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)
    return path


def _compile_and_run(x, **settings):
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with ember.config.override(backend="cpp", strict=False, **settings):
            out = torch.compile(_program, backend="ember")(x)
    return out, _ember_warnings(caught)


@pytest.fixture
def loaded_libraries(monkeypatch) -> list[str]:
    """Compiled graphs the C++ backend hands to ctypes.CDLL (not system libraries such as libmvec)."""
    paths: list[str] = []
    real = ctypes.CDLL

    def spy(path, *args, **kwargs):
        if str(path).endswith("graph.so"):
            paths.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(cpp_backend.ctypes, "CDLL", spy)
    return paths


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


def test_cache_dir_that_is_a_file_falls_back_naming_it(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    x = torch.randn(8, 16)
    out, msgs = _compile_and_run(x, cache_dir=str(blocker))
    assert_close(out, _program(x), rtol=1e-6, atol=1e-6, what="result", line="cache_dir is a file")
    assert len(msgs) == 1 and "not-a-dir" in msgs[0], msgs


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
    assert loaded_libraries == [str(so)], loaded_libraries  # loaded once, after the rebuild


def test_foreign_entry_is_never_loaded(tmp_path, monkeypatch, loaded_libraries):
    """An entry owned by another user (simulated: ember believes it runs as another uid)."""
    root = tmp_path / "cache"
    entry = DiskCache(root).put("cpp", "ab" * 32, {"graph.so": b"\x7fELF planted"})
    assert DiskCache(root).get("cpp", "ab" * 32) == entry
    monkeypatch.setattr(cache_module.os, "getuid", lambda: os.geteuid() + 1)
    assert DiskCache(root).get("cpp", "ab" * 32) is None

    # End to end: a cache written "by someone else" is neither loaded nor written into.
    monkeypatch.undo()
    x = torch.randn(8, 16)
    _compile_and_run(x, cache_dir=str(root))
    real = [p.parent for p in (root / "cpp").glob("*/*/graph.so")]
    monkeypatch.setattr(cache_module.os, "getuid", lambda: os.geteuid() + 1)
    loaded_libraries.clear()
    out, msgs = _compile_and_run(x, cache_dir=str(root))
    assert_close(out, _program(x), rtol=1e-6, atol=1e-6, what="result", line="foreign cache")
    assert not any(str(root) in p for p in loaded_libraries), f"loaded from a foreign cache: {loaded_libraries}"
    assert len(msgs) == 1 and "not owned" in msgs[0], msgs
    assert real, "the first compile should have written an entry"


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
