"""What ember holds is released: a compiled graph's shared library leaves the process once the
graph is dropped, and the private folders of processes killed mid-compile do not pile up in the
temporary folder."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch

import ember
from ember.runtime import scratch

REPO = Path(__file__).resolve().parents[2]


def _mapped_graph_libraries() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if "graph.so" in line}


def test_a_dropped_graph_unloads_its_library(tmp_path):
    def fn(x):
        return torch.sigmoid(x) * 3 - 1

    x = torch.randn(8, 8)
    gc.collect()
    before = _mapped_graph_libraries()
    for _ in range(2):  # built, then loaded from the cache
        with ember.config.override(backend="cpp", strict=True, cache_dir=str(tmp_path / "cache")):
            torch.testing.assert_close(torch.compile(fn, backend="ember")(x), fn(x))
        loaded = _mapped_graph_libraries() - before
        assert loaded, "no compiled library is mapped"
        torch._dynamo.reset()
        gc.collect()
        assert not (_mapped_graph_libraries() & loaded), f"still mapped after reset: {loaded}"


_COMPILE_ONE_GRAPH = textwrap.dedent(
    """
    import torch, ember
    x = torch.randn(8, 8)
    torch.compile(lambda x: torch.sigmoid(x) * 3, backend="ember", options={"backend": "cpp", "strict": True})(x)
    """
)


def test_a_compile_killed_mid_build_leaves_one_folder_that_the_next_process_removes(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    started = tmp_path / "started"
    cxx = tmp_path / "slow-g++"
    cxx.write_text(
        f'#!/bin/sh\ncase "$1" in --version) echo "slow g++ 1.0";; *) touch "{started}"; exec sleep 60;; esac\n'
    )
    cxx.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env.update(
        TMPDIR=str(temp),
        EMBER_CXX=str(cxx),
        EMBER_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    child = subprocess.Popen([sys.executable, "-c", _COMPILE_ONE_GRAPH], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), f"the compiler never started (exit {child.poll()})"
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the process and its compiler, mid-build
        child.wait()
    left = sorted(p.name for p in temp.iterdir())
    assert len(left) == 1 and left[0].startswith(f"ember-{child.pid}-"), f"left in the temporary folder: {left}"
    assert list((temp / left[0]).rglob("graph.cpp")), "the build did not happen in the process's private folder"

    # The next process to make its private folder removes it (once it is old enough).
    live = temp / f"ember-{os.getppid()}-live"
    live.mkdir()  # a running process's folder is kept, however old
    old = time.time() - scratch.STALE_SECONDS - 1
    for p in (temp / left[0], live):
        os.utime(p, (old, old))
    assert scratch.sweep(temp) == [temp / left[0]]
    assert sorted(p.name for p in temp.iterdir()) == [live.name]


def test_a_process_that_ends_leaves_no_folder(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBER_")}
    env.update(
        TMPDIR=str(temp),
        EMBER_CACHE_DIR=str(tmp_path / "cache"),
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
    )
    program = "from ember.runtime import scratch; b = scratch.build_folder('cpp'); (b / 'a.cpp').touch(); print(b)"
    out = subprocess.run(
        [sys.executable, "-c", program], env=env, check=True, timeout=300, capture_output=True, text=True
    )
    assert Path(out.stdout.strip()).parent.parent == temp, out.stdout
    assert not list(temp.iterdir()), list(temp.iterdir())
