"""The disk cache across processes: a second process compiling the same graphs reuses the
first one's binaries (the C++ compiler is not run again, the cache directory is not touched),
and a corrupted entry is detected and rebuilt, never loaded.

Each run is a fresh Python process with its own EMBER_CACHE_DIR. The C++ compiler is a
wrapper script that logs each invocation, so "did not compile" is checked directly.
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

PROGRAM = textwrap.dedent(
    """
    import sys
    import torch

    backend = sys.argv[1]

    def fn(x):
        return torch.softmax(x * 2, -1) + 1

    x = torch.linspace(-3, 3, 16 * 32).reshape(16, 32)
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
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> "{log}"\nexec "{real}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper, log


def _run(backend: str, cache_dir: Path, cxx: Path, tmp_path: Path) -> str:
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env.update(
        EMBER_CACHE_DIR=str(cache_dir),
        EMBER_CXX=str(cxx),
        TRITON_INTERPRET="1",
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, str(script), backend],
        check=False,
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "RESULT-OK" in proc.stdout, (
        f"subprocess failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n"
        f"repro: EMBER_CACHE_DIR={cache_dir} EMBER_CXX={cxx} python {script} {backend}"
    )
    return proc.stdout


def _compiles(log: Path) -> int:
    """How many times the wrapper was asked to build a shared library (not `--version`)."""
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if "-shared" in line.split())


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


def _entries(root: Path, kind: str) -> list[Path]:
    return sorted(p.parent for p in (root / kind).glob("*/*/manifest.json"))


def _intact(entry: Path) -> bool:
    manifest = json.loads((entry / "manifest.json").read_text())
    return all(hashlib.sha256((entry / name).read_bytes()).hexdigest() == digest for name, digest in manifest.items())


def test_cpp_cache_across_processes(tmp_path):
    cache = tmp_path / "cache"
    cxx, log = _write_cxx_wrapper(tmp_path)

    # 1. A cold cache: every graph is compiled once and stored.
    _run("cpp", cache, cxx, tmp_path)
    first = _compiles(log)
    entries = _entries(cache, "cpp")
    assert first >= 1 and len(entries) == first, f"{first} compiler runs, {len(entries)} cache entries"
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700, oct(cache.stat().st_mode)
    before = _snapshot(cache)

    # 2. A second process: no compiler run, the cache directory untouched.
    _run("cpp", cache, cxx, tmp_path)
    assert _compiles(log) == first, f"the second process ran the C++ compiler:\n{log.read_text()}"
    assert _snapshot(cache) == before, "the second process changed the cache directory"

    # 3. A truncated .so is detected (checksum), rebuilt, and replaced; results stay correct.
    victim = entries[0] / "graph.so"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    assert not _intact(entries[0])
    _run("cpp", cache, cxx, tmp_path)
    assert _compiles(log) == first + 1, f"expected exactly one rebuild:\n{log.read_text()}"
    assert _entries(cache, "cpp") == entries
    assert all(_intact(e) for e in entries), "the corrupt entry was not replaced"
    assert (entries[0] / "graph.so").read_bytes() == data


def test_triton_cache_across_processes(tmp_path):
    cache = tmp_path / "cache"
    cxx, log = _write_cxx_wrapper(tmp_path)

    _run("triton", cache, cxx, tmp_path)
    entries = _entries(cache, "triton")
    assert entries, "the Triton backend wrote no cache entries"
    before = _snapshot(cache)

    _run("triton", cache, cxx, tmp_path)
    assert _snapshot(cache) == before, "the second process changed the cache directory"
    assert _compiles(log) == 0

    victim = entries[0] / "kernels.py"
    good = victim.read_text()
    victim.write_text(good[: len(good) // 2])
    _run("triton", cache, cxx, tmp_path)
    assert _entries(cache, "triton") == entries
    assert all(_intact(e) for e in entries), "the corrupt entry was not replaced"
    assert victim.read_text() == good


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
