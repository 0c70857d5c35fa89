"""Progress of a long compile on stderr: which graph, which stage, how many kernels.

A compile that ends within the setting `progress_after_s` (seconds) prints nothing. One that runs longer
says so when it passes that mark, then whenever its stage changes, and once more when it ends:

    [ember] graph 0/0 (96 ops): forward: building 41 kernels, 14 s
    [ember] graph 0/0 (96 ops): compiled in 22 s (forward: 41 kernels, backward: 58 kernels)

On a terminal the lines replace one another and the seconds count up while a stage runs (a
daemon thread ticks every half second); elsewhere (setting `progress=on` with stderr redirected)
each stage is one line. `progress=off` silences it; the default, `auto`, reports on a terminal only.
The decisions take the clock as an argument, so tests drive them with a fake one.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from ember import config


class CompileProgress:
    """One compile's progress. `write(line, final)` prints a line; `live`: a terminal, where a
    line replaces the one before and the seconds may count up within a stage."""

    def __init__(
        self,
        graph: str,
        write: Callable[[str, bool], None],
        live: bool,
        clock: Callable[[], float] = time.monotonic,
        after_s: float = 2.0,
    ):
        self.graph, self.write, self.live, self.clock, self.after_s = graph, write, live, clock, after_s
        self.start = clock()
        self.stage = "tracing (AOTAutograd)"
        self.built: list[str] = []  # "forward: 41 kernels", one per graph ember built
        self.shown: str | None = None  # the stage last printed (None: nothing printed yet)
        self.lock = threading.Lock()

    def enter(self, stage: str) -> None:
        """The compile moved on to `stage`."""
        with self.lock:
            self.stage = stage
            self._show()

    def kernels_built(self, kind: str, count: int) -> None:
        with self.lock:
            self.built.append(f"{kind}: {count} kernel{'s' if count != 1 else ''}")

    def tick(self) -> None:
        """Time passed (the ticker calls this): past the mark, say where the compile is."""
        with self.lock:
            self._show()

    def finish(self, error: BaseException | None = None) -> None:
        """The compile ended; `error`: the exception that ended it (a Dynamo restart, strict mode)."""
        with self.lock:
            if self.shown is None:
                return  # a quick compile stays silent
            elapsed = self.clock() - self.start
            if error is not None:
                self.write(f"{self.graph}: stopped after {elapsed:.0f} s ({type(error).__name__})", True)
                return
            built = f" ({', '.join(self.built)})" if self.built else ""
            self.write(f"{self.graph}: compiled in {elapsed:.0f} s{built}", True)

    def _show(self) -> None:
        elapsed = self.clock() - self.start
        if elapsed < self.after_s or (self.stage == self.shown and not self.live):
            return
        self.shown = self.stage
        self.write(f"{self.graph}: {self.stage}, {elapsed:.0f} s", False)


class _Ticker:
    """A daemon thread that ticks every compile in progress twice a second, so a long stage still
    shows the seconds counting. Started on the first compile that reports progress."""

    def __init__(self, period_s: float = 0.5):
        self.period_s = period_s
        self.active: weakref.WeakSet[CompileProgress] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def add(self, progress: CompileProgress) -> None:
        with self.lock:
            self.active.add(progress)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="ember-progress", daemon=True)
                self.thread.start()

    def remove(self, progress: CompileProgress) -> None:
        with self.lock:
            self.active.discard(progress)

    def _run(self) -> None:
        while True:
            time.sleep(self.period_s)
            with self.lock:
                active = list(self.active)
            for progress in active:
                progress.tick()


_ticker = _Ticker()
_current = threading.local()


def _terminal_writer(stream) -> Callable[[str, bool], None]:
    def write(line: str, final: bool) -> None:
        stream.write(f"\r[ember] {line}\x1b[K" + ("\n" if final else ""))
        stream.flush()

    return write


def _line_writer(stream) -> Callable[[str, bool], None]:
    def write(line: str, final: bool) -> None:
        stream.write(f"[ember] {line}\n")
        stream.flush()

    return write


def _reporter(graph: str) -> CompileProgress | None:
    """A progress reporter for this compile, as the `progress` setting says; None: silent."""
    choice = config.get("progress")
    stream = sys.stderr
    is_terminal = bool(getattr(stream, "isatty", lambda: False)())
    if choice == "off" or (choice == "auto" and not is_terminal):
        return None
    write = _terminal_writer(stream) if is_terminal else _line_writer(stream)
    return CompileProgress(graph, write, live=is_terminal, after_s=config.get("progress_after_s"))


@contextlib.contextmanager
def compiling(graph: Callable[[], str]) -> Iterator[None]:
    """Report the progress of the compile inside, unless an outer one on this thread already does
    (the forward and backward graphs of one Dynamo graph report as one). `graph` names it."""
    if getattr(_current, "progress", None) is not None:
        yield
        return
    progress = _reporter(graph())
    if progress is None:
        yield
        return
    _current.progress = progress
    _ticker.add(progress)
    error = None
    try:
        yield
    except BaseException as e:
        error = e
        raise
    finally:
        _ticker.remove(progress)
        _current.progress = None
        progress.finish(error)


def stage(name: str) -> None:
    """The compile on this thread moved on to stage `name`."""
    progress = getattr(_current, "progress", None)
    if progress is not None:
        progress.enter(name)


def kernels_built(kind: str, count: int) -> None:
    progress = getattr(_current, "progress", None)
    if progress is not None:
        progress.kernels_built(kind, count)
