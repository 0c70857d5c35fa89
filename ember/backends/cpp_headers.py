"""The standard headers of ember's C++ sources, parsed once: a precompiled header for g++.

Every C++ source ember generates begins with the same standard headers (codegen/cpp.py's `PRELUDE`), and
g++ spends most of a small graph's build parsing them: on the 2-core Zen 3 machine, a layer norm and
softmax graph took 0.47 s to build, of which parsing <cmath> and <algorithm> took 0.41 s; with the
headers precompiled it took 0.20 s, and the library's machine code was the same.

The precompiled header is built once per compiler, flags and CPU (g++ uses one only if it was made
with the library's own options), by a thread that the first build of a process starts, so that no
build waits for it: builds before it is ready parse the headers themselves. It is kept in the disk cache
(kind "pch", which a portable cache file leaves out; about 19 MB with GCC 12), with the size and
modification time of every header file it read: where one has changed since (a system update under the
same compiler version) it is stale, and the header for the files as they are now is found or built under
a key of their stamps. A process uses a private copy (runtime/scratch.py), as for libraries; a forked
child starts without one.

Only a source that begins with the prelude's own include lines is built with it (`-include` of a file
with exactly those lines, in that order: the source's own includes then add nothing), and only by GCC,
whose `.gch` files these are. A precompiled header changes how long a build takes, never what it
makes: where g++ refuses it, it says so (`-Winvalid-pch`) and parses the header's text beside it; where
it fails on it (a copy cut short or removed), the build runs again without it. Either way the process
uses it no more (`forget`).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

from ember import config, log
from ember.runtime import scratch
from ember.runtime.cache import DiskCache, content_key

HEADER_NAME = "ember_prelude.h"
_INCLUDE = re.compile(r"#include <[^>\n]+>\n")

_lock = threading.Lock()
_ready: dict[tuple, Path] = {}  # (cxx, flags, includes, CPU arch) -> the header's path, its .gch beside it
_started: set[tuple] = set()
_running: set[subprocess.Popen] = set()  # header builds under way
_threads: list[threading.Thread] = []
_stopping = False  # the process is exiting: no header build runs on
# What an entry holds: the precompiled header, and the stamps of the header files it read (headers.json).
FORMAT = "gch+stamps/1"
MAX_STALE = 4  # stale entries followed, at most; past them a header is built for this process alone


def _reset_in_child() -> None:
    """A forked child starts with no header: its parent's private copy goes with the parent, and the lock
    may have been held by another thread at the fork."""
    global _lock
    _lock = threading.Lock()
    _ready.clear()
    _started.clear()
    _running.clear()
    _threads.clear()


os.register_at_fork(after_in_child=_reset_in_child)


def include_block(prelude: str) -> str:
    """The include lines at the start of `prelude` (blank lines before them skipped)."""
    text = prelude.lstrip("\n")
    lines = []
    pos = 0
    while (m := _INCLUDE.match(text, pos)) is not None:
        lines.append(m.group(0))
        pos = m.end()
    return "".join(lines)


def flags_for(
    cxx: str, flags: list[str], includes: str, source: str, arch: object, identity: str, gcc: bool
) -> list[str]:
    """The extra g++ arguments that build `source` on the precompiled `includes` for CPU `arch`: none until
    the header is ready (its build is started here, once), or where it does not apply (not GCC, a source that
    does not begin with these includes, the setting off)."""
    if not (config.get("cpp_precompiled_header") and includes and gcc):
        return []
    if not source.lstrip("\n").startswith(includes):
        return []
    key = (cxx, tuple(flags), includes, arch)
    with _lock:
        header = _ready.get(key)
        if header is not None and not (header.exists() and Path(f"{header}.gch").exists()):
            # Its private copy is gone (a cleaner of the temporary folder): g++ would fail on a missing
            # -include. Made or read again.
            del _ready[key]
            _started.discard(key)
            header = None
        if header is None and key not in _started:
            _started.add(key)
            # The caller's settings (they are per thread): the disk cache it uses, its logs.
            settings = config.snapshot()
            thread = threading.Thread(
                target=_make, args=(key, identity, settings), name="ember-cpp-header", daemon=True
            )
            _threads.append(thread)
            thread.start()
    return [] if header is None else ["-include", str(header), "-Winvalid-pch"]


def forget(header_flags: list[str], why: str) -> None:
    """The header those flags name is not used again in this process (a build failed with it and succeeded
    without it, or g++ refused it)."""
    if "-include" not in header_flags:
        return
    header = Path(header_flags[header_flags.index("-include") + 1])
    with _lock:
        for key in [k for k, path in _ready.items() if path == header]:
            del _ready[key]  # still in _started: not built again
    log.artifact("cache", "precompiled C++ header dropped", f"{header}: {why.strip()[:500]}")


def _make(key: tuple, identity: str, settings: dict) -> None:
    cxx, flags, includes, arch = key
    try:
        with config.override(**settings):
            header = _load_or_build(cxx, list(flags), includes, arch, identity)
    except Exception as e:  # noqa: BLE001 - never fatal: builds parse the headers instead
        log.artifact("cache", "no precompiled C++ header", f"{type(e).__name__}: {e}")
        return
    if header is not None:
        with _lock:
            _ready[key] = header


def _load_or_build(cxx: str, flags: list[str], includes: str, arch: object, identity: str) -> Path | None:
    compile_flags = [f for f in flags if f != "-shared"]  # a header is compiled, not linked
    made_by = (identity, compile_flags)
    cache = DiskCache()
    cache_key = content_key("pch", FORMAT, includes, target=arch, toolchain=made_by)
    # A stale entry (a header file changed since) is followed by the entry of the files' present stamps,
    # and so on: the cache keeps the entry written first, so a newer header lives under a key of its own.
    for _ in range(MAX_STALE):
        hit = cache.get("pch", cache_key)
        if hit is None:
            break
        stamps = json.loads(hit["headers.json"])
        if _unchanged(stamps):
            return _private(includes, hit["header.gch"])
        cache_key = content_key("pch", FORMAT, includes, _now(stamps), target=arch, toolchain=made_by)
    build = scratch.build_folder("pch")
    try:
        (build / HEADER_NAME).write_text(includes)
        out = build / (HEADER_NAME + ".gch")
        # Relative names, run in the build folder: the dependency list then names no temporary path.
        cmd = [cxx, *compile_flags, "-x", "c++-header", HEADER_NAME, "-o", out.name, "-MD", "-MF", "deps.d"]
        returncode, stderr = _run(cmd, build)
        if returncode != 0 or not out.exists():
            log.artifact("cache", "no precompiled C++ header", f"{cxx} exited {returncode}: {stderr.strip()[:500]}")
            return None
        read = _stamps(_dependencies((build / "deps.d").read_text()))
        data = out.read_bytes()
        cache.put("pch", cache_key, {"header.gch": data, "headers.json": json.dumps(read).encode()})
        return _private(includes, data)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _run(cmd: list[str], cwd: Path) -> tuple[int, str]:
    """Run g++, which the process's exit stops: a daemon thread is abandoned at exit, its child would
    not be."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with _lock:
        _running.add(proc)
        if _stopping:  # started as the process exits
            proc.kill()
    try:
        _, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
    finally:
        with _lock:
            _running.discard(proc)
    return proc.returncode, stderr


@atexit.register
def _stop_running() -> None:
    global _stopping
    with _lock:
        _stopping = True
        for proc in _running:
            proc.kill()


def _private(includes: str, gch: bytes) -> Path:
    """The header and its precompiled form, written to a new folder of this process's private folder."""
    folder = scratch.build_folder("pch-use")
    (folder / (HEADER_NAME + ".gch")).write_bytes(gch)
    header = folder / HEADER_NAME
    header.write_text(includes)
    return header


def _dependencies(make_rule: str) -> list[str]:
    """The files a `-MD` rule names, the header itself left out (named relative to the build folder)."""
    body = make_rule.replace("\\\n", " ").split(":", 1)[1]
    return [p for p in body.split() if p != HEADER_NAME]


def _stat(path: str) -> list[int] | None:
    """A file's size and modification time (of what a link names); None where it is gone."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


def _stamps(paths: list[str]) -> dict[str, list[int] | None]:
    """Each file's stamp, by the name g++ read it by."""
    return {p: _stat(p) for p in paths}


def _unchanged(stamps: dict[str, list[int]]) -> bool:
    """Whether every header file the precompiled header read is as it was when it was built."""
    return bool(stamps) and all(now is not None and now == stamp for now, stamp in zip(_now(stamps), stamps.values()))


def _now(stamps: dict[str, list[int]]) -> list[list[int] | None]:
    """The stamps of the files `stamps` names, as they are now."""
    return [_stat(p) for p in stamps]


def wait(timeout: float = 120.0) -> None:
    """Wait for the header builds this process started to end (ready or not)."""
    with _lock:
        threads = list(_threads)
    for thread in threads:
        thread.join(timeout)
