"""The Triton compile workers (ember/backends/compile_workers.py): every kernel sent is handed
back to the parent, whether its worker compiled it, failed on it or died."""

from __future__ import annotations

import threading
import time

from ember.backends import compile_workers
from ember.backends.compile_workers import CompileWorkers


def _run(workers: CompileWorkers, jobs: list[tuple], path: str) -> list[str]:
    handed_back: list[str] = []
    lock = threading.Lock()

    def done(names):
        with lock:
            handed_back.extend(names)

    workers.compile("ember_kernels_test", path, jobs, done)
    return handed_back


def test_a_worker_that_cannot_start_hands_every_kernel_back(tmp_path):
    # Without a GPU no Triton driver is active and the workers exit while setting the target up;
    # with one, the empty module has none of these kernels. Either way the parent gets them all.
    module = tmp_path / "kernels.py"
    module.write_text("")
    workers = CompileWorkers(2, ("cuda", 90, 32))
    try:
        jobs = [(f"k{i}", [], {}, 4, True) for i in range(11)]
        handed_back = _run(workers, jobs, str(module))
        assert sorted(handed_back) == sorted(f"k{i}" for i in range(11))
        assert workers.failures
    finally:
        workers.close()


def _stub_triton(tmp_path, monkeypatch) -> None:
    """A stand-in for Triton's driver, so that a worker starts on a machine without a GPU."""
    stub = tmp_path / "stub"
    (stub / "triton" / "backends").mkdir(parents=True)
    (stub / "triton" / "runtime").mkdir(parents=True)
    (stub / "triton" / "__init__.py").write_text("")
    (stub / "triton" / "backends" / "__init__.py").write_text("")
    (stub / "triton" / "backends" / "compiler.py").write_text(
        "class GPUTarget:\n    def __init__(self, *a):\n        self.a = a\n"
    )
    (stub / "triton" / "runtime" / "__init__.py").write_text("from .driver import driver\n")
    (stub / "triton" / "runtime" / "driver.py").write_text("class _D:\n    pass\n\nclass driver:\n    active = _D()\n")
    monkeypatch.setenv("PYTHONPATH", str(stub))


def test_a_kernel_a_worker_fails_on_is_handed_back_and_reported(tmp_path, monkeypatch):
    _stub_triton(tmp_path, monkeypatch)  # the module's "kernels" raise
    module = tmp_path / "kernels.py"
    module.write_text(
        "class _K:\n"
        "    def __init__(self, ok):\n        self.ok = ok\n"
        "    def warmup(self, *args, **kwargs):\n"
        "        if not self.ok:\n            raise ValueError('no')\n"
        "good = _K(True)\nbad = _K(False)\n"
    )
    workers = CompileWorkers(1, ("cuda", 90, 32))
    try:
        jobs = [("good", [1], {"XBLOCK": 8}, 4, True), ("bad", [2], {}, 4, False)] * 3
        handed_back = _run(workers, jobs, str(module))
        assert sorted(handed_back) == sorted(["good", "bad"] * 3)
        assert workers.failures == ["bad: ValueError: no"] * 3
        assert workers.procs[0].poll() is None  # still serving
    finally:
        workers.close()


def test_a_worker_that_does_not_answer_is_stopped_and_its_kernels_handed_back(tmp_path, monkeypatch):
    _stub_triton(tmp_path, monkeypatch)
    module = tmp_path / "kernels.py"
    module.write_text("import time\nclass _K:\n    def warmup(self, *a, **k):\n        time.sleep(30)\nslow = _K()\n")
    workers = CompileWorkers(1, ("cuda", 90, 32), batch_timeout_s=1.0)
    try:
        handed_back = _run(workers, [("slow", [], {}, 4, True)] * 6, str(module))
        assert sorted(handed_back) == ["slow"] * 6
        assert len(workers.failures) == 1 and "TimeoutError" in workers.failures[0]
        assert workers.alive == 0
    finally:
        workers.close()


def _ready_within(workers: CompileWorkers, count: int, seconds: float = 30.0) -> int:
    deadline = time.monotonic() + seconds
    while (ready := workers.ready_count()) < count and time.monotonic() < deadline:
        time.sleep(0.05)
    return ready


def test_ready_workers_share_a_few_kernels_between_them(tmp_path, monkeypatch):
    # Started early, workers say when they are ready; a graph of four kernels is then cut into
    # batches that keep both busy, where batches of BATCH kernels would have given one worker all four.
    _stub_triton(tmp_path, monkeypatch)
    pids = tmp_path / "pids"
    module = tmp_path / "kernels.py"
    module.write_text(
        "import os, time\n"
        "class _K:\n"
        "    def warmup(self, *args, **kwargs):\n"
        f"        open({str(pids)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
        "        time.sleep(0.5)\n"
        "k = _K()\n"
    )
    workers = CompileWorkers(2, ("cuda", 90, 32))
    try:
        assert _ready_within(workers, 2) == 2
        handed_back = []
        workers.compile("ember_kernels_test", str(module), [("k", [], {}, 4, True)] * 4, handed_back.extend, True)
        assert handed_back == ["k"] * 4 and not workers.failures
        assert len(set(pids.read_text().split())) == 2
    finally:
        workers.close()


def test_a_worker_that_cannot_start_is_never_counted_ready(tmp_path, monkeypatch):
    # A Triton whose driver cannot be set up (as without a GPU): the workers exit while starting.
    _stub_triton(tmp_path, monkeypatch)
    (tmp_path / "stub" / "triton" / "runtime" / "driver.py").write_text(
        "class driver:\n    @property\n    def active(self):\n        raise RuntimeError('0 active drivers')\n"
        "driver = driver()\n"
    )
    workers = CompileWorkers(2, ("cuda", 90, 32))
    try:
        for proc in workers.procs:
            proc.wait(timeout=60)
        assert workers.ready_count() == 0 and workers.alive == 0
    finally:
        workers.close()


def test_started_names_only_a_live_pool_for_the_same_target(monkeypatch):
    class Pool:
        target, alive = ("cuda", 90, 32), 2

    monkeypatch.setattr(compile_workers, "_workers", Pool())
    pool = compile_workers._workers
    assert compile_workers.started(("cuda", 90, 32)) is pool
    assert compile_workers.started(("cuda", 80, 32)) is None
    Pool.alive = 0
    assert compile_workers.started(("cuda", 90, 32)) is None
