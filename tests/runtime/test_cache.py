"""The disk cache across processes: a second process compiling the same graphs reuses the
first one's binaries (the C++ compiler is not run again, the cache directory is not touched),
and a corrupted entry is detected and rebuilt, never loaded.

Each run is a fresh Python process with its own EMBER_CACHE_DIR, compiling the same program with
each code generator in turn (a process's start is most of a warm run, so the two share it). The
C++ compiler is a wrapper script that logs each invocation under the code generator that was
compiling, so "did not compile" is checked directly, per code generator.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ember

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ("cpp", "triton")

PROGRAM = textwrap.dedent(
    """
    import os
    import sys
    import torch

    def fn(x):
        return torch.softmax(x * 2, -1) + 1

    x = torch.linspace(-3, 3, 16 * 32).reshape(16, 32)
    for backend in sys.argv[1:]:
        os.environ["CXX_LOG_TAG"] = backend  # the compiler wrapper's log names who asked
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="ember", options={"strict": True, "backend": backend})
        torch.testing.assert_close(compiled(x), fn(x))          # an inference graph
        xg = x.clone().requires_grad_(True)
        compiled(xg).sum().backward()                            # a forward and a backward graph
        xe = x.clone().requires_grad_(True)
        fn(xe).sum().backward()
        torch.testing.assert_close(xg.grad, xe.grad)
    print("RESULT-OK")
    """
)


def _write_cxx_wrapper(tmp_path: Path) -> tuple[Path, Path]:
    log = tmp_path / "cxx.log"
    wrapper = tmp_path / "logging-g++"
    real = shutil.which("g++")
    assert real, "these tests need g++"
    wrapper.write_text(f'#!/bin/sh\necho "[$CXX_LOG_TAG] $@" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def _run(cache_dir: Path, cxx: Path, tmp_path: Path) -> str:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env.update(
        EMBER_CACHE_DIR=str(cache_dir),
        EMBER_CXX=str(cxx),
        # No precompiled header: its build runs in the background and may end after the process's graphs, and
        # these tests count what each process writes (backends/cpp_headers.py has its own tests).
        EMBER_CPP_PRECOMPILED_HEADER="0",
        TRITON_INTERPRET="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, str(script), *BACKENDS],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "RESULT-OK" in proc.stdout, (
        f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n"
        f"repro: EMBER_CACHE_DIR={cache_dir} EMBER_CXX={cxx} python {script} {' '.join(BACKENDS)}"
    )
    return proc.stdout


def _compiles(log: Path, backend: str | None = None) -> int:
    """How many times the wrapper was asked to build a shared library (not `--version`), by any
    code generator or while `backend` compiled."""
    if not log.exists():
        return 0
    lines = [line.split() for line in log.read_text().splitlines()]
    return sum(1 for words in lines if "-shared" in words and backend in (None, words[0][1:-1]))


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _entries(root: Path, kind: str) -> list[Path]:
    return sorted(p.parent for p in (root / kind).glob("*/*/manifest.json"))


def _intact(entry: Path) -> bool:
    manifest = json.loads((entry / "manifest.json").read_text())
    return all(hashlib.sha256((entry / name).read_bytes()).hexdigest() == digest for name, digest in manifest.items())


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Three processes on one cache: cold; warm; then after one entry of each code generator was
    damaged (a truncated .so, a truncated kernel module). What the tests check is recorded between
    the runs; they only read it."""
    tmp_path = tmp_path_factory.mktemp("cache-across-processes")
    cache = tmp_path / "cache"
    cxx, log = _write_cxx_wrapper(tmp_path)
    seen: dict = {"log": log}

    # 1. A cold cache: every graph is compiled once and stored.
    _run(cache, cxx, tmp_path)
    seen["cold"] = {b: _compiles(log, b) for b in BACKENDS}
    seen["entries"] = entries = {b: _entries(cache, b) for b in BACKENDS}
    seen["mode"] = stat.S_IMODE(cache.stat().st_mode)
    before = _snapshot(cache)

    # 2. A second process: no compiler run, the cache directory untouched.
    _run(cache, cxx, tmp_path)
    seen["warm"] = {b: _compiles(log, b) for b in BACKENDS}
    seen["warm_untouched"] = _snapshot(cache) == before

    # 3. Damaged entries: a C++ library cut in half, a Triton kernel module cut in half.
    assert all(entries.values()), f"a code generator wrote no cache entries: {entries}"
    damaged = {"cpp": entries["cpp"][0] / "graph.so", "triton": entries["triton"][0] / "kernels.py"}
    seen["good"] = {b: path.read_bytes() for b, path in damaged.items()}
    for path in damaged.values():
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    seen["detected"] = {b: not _intact(entries[b][0]) for b in BACKENDS}
    _run(cache, cxx, tmp_path)
    seen["rebuilt"] = {b: _compiles(log, b) for b in BACKENDS}
    seen["entries_after"] = {b: _entries(cache, b) for b in BACKENDS}
    seen["intact_after"] = {b: all(_intact(e) for e in seen["entries_after"][b]) for b in BACKENDS}
    seen["after"] = {b: path.read_bytes() for b, path in damaged.items()}
    return seen


def test_cpp_cache_across_processes(runs):
    log, entries = runs["log"], runs["entries"]["cpp"]
    # 1. A cold cache: every graph is compiled once and stored.
    first = runs["cold"]["cpp"]
    assert first >= 1 and len(entries) == first, f"{first} compiler runs, {len(entries)} cache entries"
    assert runs["mode"] == 0o700, oct(runs["mode"])

    # 2. A second process: no compiler run, the cache directory untouched.
    assert runs["warm"]["cpp"] == first, f"the second process ran the C++ compiler:\n{log.read_text()}"
    assert runs["warm_untouched"], "the second process changed the cache directory"

    # 3. A truncated .so is detected (checksum), rebuilt, and replaced; results stay correct.
    assert runs["detected"]["cpp"]
    assert runs["rebuilt"]["cpp"] == first + 1, f"expected exactly one rebuild:\n{log.read_text()}"
    assert runs["entries_after"]["cpp"] == entries
    assert runs["intact_after"]["cpp"], "the corrupt entry was not replaced"
    assert runs["after"]["cpp"] == runs["good"]["cpp"]


def test_triton_cache_across_processes(runs):
    log, entries = runs["log"], runs["entries"]["triton"]
    assert entries, "the Triton backend wrote no cache entries"

    assert runs["warm_untouched"], "the second process changed the cache directory"
    assert runs["cold"]["triton"] == runs["warm"]["triton"] == 0, log.read_text()

    assert runs["detected"]["triton"]
    assert runs["entries_after"]["triton"] == entries
    assert runs["intact_after"]["triton"], "the corrupt entry was not replaced"
    assert runs["after"]["triton"] == runs["good"]["triton"]


# -- in-process: the `cache` setting --------------------------------------------------------


@pytest.mark.parametrize("use_cache,expected_builds", [(True, 1), (False, 2)])
def test_cache_setting(tmp_path, use_cache, expected_builds):
    """With the cache on, compiling the same graph again (after a Dynamo reset) reuses the binary."""
    cxx, log = _write_cxx_wrapper(tmp_path)

    def fn(x):
        return torch.sigmoid(x) * 3 - 1

    x = torch.randn(8, 8)
    for _ in range(2):
        torch._dynamo.reset()
        with ember.config.override(
            cxx=str(cxx), cache=use_cache, cache_dir=str(tmp_path / "cache"), strict=True, backend="cpp"
        ):
            out = torch.compile(fn, backend="ember")(x)
        torch.testing.assert_close(out, fn(x))
    assert _compiles(log) == expected_builds, log.read_text()
