"""Triton compiles in worker processes, so that a graph's kernels compile without sharing a GIL.

Triton's front end (the AST walk that emits TTIR) is Python and holds the GIL. On the H100
machine ResNet-50's 478 training kernels took 86 s to compile in one thread, 25 s in 8 and
23 s in 16 (the build stage of a cold `ember bench --compile-time`). Workers are separate processes, started once per
process and kept; each compiles the kernels it is sent through Triton's own `warmup`, for the
parent's GPU target, so the results land in Triton's disk cache under the keys the parent's
warmup then looks up. The parent still warms up (loads) every kernel itself: a worker that
fails, dies or computes another key costs time, never a kernel or a wrong one.

Workers are plain subprocesses (`python -m ember.backends.compile_workers`), not
multiprocessing: a spawned multiprocessing child re-imports the user's `__main__` script. Each answer
carries the batch's Triton stage times (ember/stats.py). They
talk over stdin/stdout in length-prefixed pickles; their stderr is discarded. A worker never
creates a CUDA context: Triton's driver is told the target instead of asking the GPU.

A worker says when it is ready (Triton imported, the target set), so that a pool started early,
when the first graph arrives (backends/triton.py: start_compile_workers) or by a large graph's build,
serves later graphs of a few kernels once it is up; a small graph that comes sooner compiles in the
parent's threads instead of waiting for it. Workers run at a lower priority (`NICENESS`): started
early, they import while the parent traces and schedules, and should not take its cores.
"""

from __future__ import annotations

import atexit
import os
import pickle
import queue
import select
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from ember import stats

# Options of every kernel's compile and launch besides its warps and contraction. A kernel that checks
# the rows it gathers or stores at is compiled in debug mode (codegen/triton.py: jit_decorator), which
# would also check its 32-bit index arithmetic for overflow; eager's index math does not, and Inductor
# turns those checks off too. Without debug mode the option changes nothing.
KERNEL_OPTIONS = {"sanitize_overflow": False}

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Kernels per message: small enough to spread a graph's kernels evenly over the workers.
BATCH = 4
# A worker that has not answered a batch in this long is stopped (its kernels go back to the parent).
BATCH_TIMEOUT_S = 300.0
# How much lower a worker's scheduling priority is than the parent's (os.nice).
NICENESS = 5
# What a worker sends once it can compile.
READY = "ready"


def _send(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    header = stream.read(8)
    if len(header) < 8:
        raise EOFError("compile worker closed its pipe")
    (size,) = struct.unpack("<Q", header)
    return pickle.loads(stream.read(size))


class CompileWorkers:
    """A fixed set of worker processes compiling Triton kernels for one GPU target."""

    def __init__(self, count: int, target: tuple, batch_timeout_s: float = BATCH_TIMEOUT_S):
        """`count` workers compiling for Triton's GPU `target`; one that has not answered a batch
        in `batch_timeout_s` is stopped."""
        self.target = target
        self.batch_timeout_s = batch_timeout_s
        self.procs = []
        for _ in range(count):
            # Started in ember's own root, which `-m` puts first on sys.path: this ember is the one
            # imported, whatever the caller's working directory holds.
            proc = subprocess.Popen(
                [sys.executable, "-m", "ember.backends.compile_workers"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                cwd=_ROOT,
            )
            _send(proc.stdin, {"target": target})
            self.procs.append(proc)
        self.alive = len(self.procs)
        self.failures: list[str] = []  # the last compile's kernels a worker could not compile, with why
        self._ready: set[int] = set()  # pids of the workers that said they are ready
        self._lock = threading.Lock()  # one compile at a time: the pipes carry one exchange each

    def _await_ready(self, proc, timeout: float) -> bool:
        """Whether `proc` is ready, waiting up to `timeout` seconds for it to say so; raises if it
        exited or said something else."""
        if proc.pid in self._ready:
            return True
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        if not ready:
            return False
        message = _receive(proc.stdout)
        if message != READY:
            raise EOFError(f"compile worker said {message!r} before it was ready")
        self._ready.add(proc.pid)
        return True

    def ready_count(self) -> int:
        """How many workers are ready now (without waiting); a worker that failed to start is stopped."""
        if not self._lock.acquire(blocking=False):
            return 0  # another thread is compiling through them
        try:
            count = 0
            for proc in self.procs:
                if proc.poll() is not None:
                    continue
                try:
                    count += self._await_ready(proc, 0.0)
                except Exception:  # noqa: BLE001  (it will not serve: stop it)
                    proc.kill()
                    proc.wait()
            self.alive = sum(p.poll() is None for p in self.procs)
            return count
        finally:
            self._lock.release()

    def compile(
        self,
        module_name: str,
        path: str,
        jobs: list[tuple],
        done: Callable[[list[str]], None],
        ready_only: bool = False,
    ) -> None:
        """Compile `jobs` ((kernel name, args, constexprs, num_warps, fp_fusion), for the kernels of
        the module at `path`) across the workers; `done(names)` is called as each batch ends, also
        when it failed. Returns when every batch has. `ready_only`: only the workers ready now
        serve (the others are still starting); otherwise each is waited for."""
        with self._lock:
            self.failures = []
            try:
                self._compile(module_name, path, jobs, done, ready_only)
            except BaseException:
                # Interrupted while serve threads may still talk to the workers: never reuse them.
                self.close()
                raise

    def _compile(
        self, module_name: str, path: str, jobs: list[tuple], done: Callable[[list[str]], None], ready_only: bool
    ) -> None:
        serving = [p for p in self.procs if p.poll() is None and (not ready_only or p.pid in self._ready)]
        # Batches of up to BATCH kernels, smaller where that spreads a few kernels over more workers.
        size = max(1, min(BATCH, -(-len(jobs) // max(1, len(serving)))))
        batches: queue.Queue = queue.Queue()
        for k in range(0, len(jobs), size):
            batches.put(jobs[k : k + size])

        def serve(proc) -> None:
            try:
                if not self._await_ready(proc, self.batch_timeout_s):
                    raise TimeoutError(f"not ready in {self.batch_timeout_s:g} s")
            except Exception as e:  # noqa: BLE001  (it will not serve: the others or the parent compile)
                self.failures.append(f"worker {proc.pid}: {type(e).__name__}: {e}")
                proc.kill()
                proc.wait()
                return
            while True:
                try:
                    batch = batches.get_nowait()
                except queue.Empty:
                    return
                names = [job[0] for job in batch]
                try:
                    if proc.poll() is not None:
                        raise EOFError("compile worker exited")
                    _send(proc.stdin, (module_name, path, batch))
                    ready, _, _ = select.select([proc.stdout], [], [], self.batch_timeout_s)
                    if not ready:
                        raise TimeoutError(f"no answer in {self.batch_timeout_s:g} s")
                    results, times = _receive(proc.stdout)
                    for stage, seconds in times.items():
                        stats.add(stage, seconds)
                    for name, error in results:
                        if error:
                            self.failures.append(f"{name}: {error}")
                except Exception as e:  # noqa: BLE001  (any failure: this worker is done; the parent compiles)
                    self.failures.append(f"worker {proc.pid}: {type(e).__name__}: {e}")
                    proc.kill()
                    proc.wait()
                    done(names)
                    self._drain(batches, done)
                    return
                done(names)

        threads = [threading.Thread(target=serve, args=(p,), daemon=True) for p in serving]
        self.alive = len(threads)
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._drain(batches, done)  # no worker left alive
        self.alive = sum(p.poll() is None for p in self.procs)

    @staticmethod
    def _drain(batches: queue.Queue, done: Callable[[list[str]], None]) -> None:
        while True:
            try:
                batch = batches.get_nowait()
            except queue.Empty:
                return
            done([job[0] for job in batch])

    def close(self) -> None:
        self.alive = 0
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


_workers: CompileWorkers | None = None
_lock = threading.Lock()


def get(count: int, target: tuple) -> CompileWorkers | None:
    """The process's workers (started on first use), or None where there are none to be had.
    Fewer than two is none: one worker compiles serially, slower than this process's threads."""
    global _workers
    if count < 2:
        return None
    with _lock:
        if _workers is not None and (_workers.target != target or _workers.alive == 0):
            _workers.close()
            _workers = None
        if _workers is None:
            try:
                _workers = CompileWorkers(count, target)
            except OSError:
                return None
        return _workers


def started(target: tuple) -> CompileWorkers | None:
    """The process's workers for `target` if they were started and some are alive; starts none."""
    with _lock:
        if _workers is not None and _workers.target == target and _workers.alive:
            return _workers
        return None


def compile_beside(workers: CompileWorkers, first, rest, module, ready_only: bool, threads: int, warmup) -> dict:
    """The workers compile the jobs `rest` into Triton's disk cache while this thread compiles `first`
    with `warmup` (setting up Triton's per-device state once); as each batch ends, one of `threads`
    threads loads its kernels (cache hits) or compiles what a worker could not. Returns each kernel's
    compiled form. A first kernel that fails or is interrupted closes the workers and loads nothing more."""
    by_name = {job[0]: job for job in rest}
    futures: dict = {}
    first_done = threading.Event()
    cancelled = threading.Event()

    def load(job):
        first_done.wait()
        return None if cancelled.is_set() else warmup(*job[1:])

    with ThreadPoolExecutor(threads) as pool:
        lock = threading.Lock()

        def loaded(names: list[str]) -> None:
            with lock:
                futures.update({n: pool.submit(load, by_name[n]) for n in names})

        worker_jobs = [(name, *job[2:]) for name, job in by_name.items()]
        raised: list[BaseException] = []

        def compile_in_workers() -> None:
            try:
                workers.compile(module.__name__, module.__file__, worker_jobs, loaded, ready_only)
            except BaseException as e:  # noqa: BLE001  (raised again in the calling thread below)
                raised.append(e)

        serving = threading.Thread(target=compile_in_workers, daemon=True)
        serving.start()
        try:
            compiled = {first[0]: warmup(*first[1:])}
        except BaseException:
            cancelled.set()
            workers.close()  # their serve threads end at once; the caller falls back or stops
            raise
        finally:
            first_done.set()
            serving.join()
        if raised:
            raise raised[0]
        compiled.update({name: future.result() for name, future in futures.items()})
    return compiled


def _close_at_exit() -> None:
    if _workers is not None:
        _workers.close()


atexit.register(_close_at_exit)


# -- the worker ---------------------------------------------------------------------------------


def _serve() -> None:
    # Replies go out on the original stdout; anything else printing to fd 1 goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    setup = _receive(inp)
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    import importlib.util

    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    target = GPUTarget(*setup["target"])
    active = driver.active
    active.get_current_target = lambda: target
    active.get_current_device = lambda: 0
    active.get_current_stream = lambda *args: 0
    modules: dict = {}
    stats.listen_to_triton()  # each batch's Triton stage times go back with its results
    _send(out, READY)
    while True:
        try:
            module_name, path, batch = _receive(inp)
        except EOFError:
            return
        module = modules.get(path)
        if module is None:
            spec = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
            modules[path] = module
        results = []
        before = stats.snapshot()
        for name, args, consts, num_warps, fp_fusion in batch:
            try:
                getattr(module, name).warmup(
                    *args, grid=(1,), num_warps=num_warps, enable_fp_fusion=fp_fusion, **KERNEL_OPTIONS, **consts
                )
                results.append((name, None))
            except Exception as e:  # noqa: BLE001  (any failure: the parent compiles it again and reports it)
                results.append((name, f"{type(e).__name__}: {e}"[:300]))
        _send(out, (results, stats.delta(before)))


if __name__ == "__main__":
    _serve()
