"""The standard headers of ember's C++ sources, parsed once: a precompiled header for g++.

Every C++ source ember generates begins with the same standard headers (codegen/cpp.py's `PRELUDE`), and
g++ spends most of a small graph's build parsing them: on the 2-core Zen 3 machine, a layer norm and
softmax graph took 0.47 s to build, of which parsing <cmath> and <algorithm> took 0.41 s; with the
headers precompiled it took 0.20 s, and the library's machine code was the same.

The precompiled header is built once per compiler, flags and CPU (g++ uses one only if it was made
with the library's own options), by a thread that the first build of a process starts, so that no
build waits for it: builds before it is ready parse the headers as before. It is kept in the disk cache
(kind "pch", which a portable cache file leaves out), with the size and modification time of every
header file it read: where one has changed since (a system update under the same compiler version) it
is stale and is built again. A process uses a private copy (runtime/scratch.py), as for libraries.

Only a source that begins with the prelude's own include lines is built with it (`-include` of a file
with exactly those lines, in that order: the source's own includes then add nothing), and only by GCC,
whose `.gch` files these are. A precompiled header changes how long a build takes, never what it
makes: where g++ cannot use it, it says so (`-Winvalid-pch`) and parses the header's text beside it.
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
_ready: dict[tuple, Path] = {}  # (cxx, flags, includes, target key) -> the header's path, its .gch beside it
_started: set[tuple] = set()
_running: set[subprocess.Popen] = set()  # header builds under way
_threads: list[threading.Thread] = []


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
    cxx: str, flags: list[str], includes: str, source: str, target_key: object, identity: str, gcc: bool
) -> list[str]:
    """The extra g++ arguments that build `source` on the precompiled `includes`: none until the header
    is ready (its build is started here, once), or where it does not apply (not GCC, a source that does
    not begin with these includes, the setting off)."""
    if not (config.get("cpp_precompiled_header") and includes and gcc):
        return []
    if not source.lstrip("\n").startswith(includes):
        return []
    key = (cxx, tuple(flags), includes, target_key)
    with _lock:
        header = _ready.get(key)
        if header is None and key not in _started:
            _started.add(key)
            # The disk cache the build's caller sees (settings are per thread).
            cache = {"cache": config.get("cache"), "cache_dir": config.get("cache_dir")}
            thread = threading.Thread(target=_make, args=(key, identity, cache), name="ember-cpp-header", daemon=True)
            _threads.append(thread)
            thread.start()
    return [] if header is None else ["-include", str(header), "-Winvalid-pch"]


def _make(key: tuple, identity: str, cache: dict) -> None:
    cxx, flags, includes, target_key = key
    try:
        with config.override(**cache):
            header = _load_or_build(cxx, list(flags), includes, target_key, identity)
    except (OSError, ValueError, subprocess.SubprocessError) as e:  # never fatal: builds parse the headers
        log.artifact("cache", "no precompiled C++ header", f"{type(e).__name__}: {e}")
        return
    if header is not None:
        with _lock:
            _ready[key] = header


def _load_or_build(cxx: str, flags: list[str], includes: str, target_key: object, identity: str) -> Path | None:
    compile_flags = [f for f in flags if f != "-shared"]  # a header is compiled, not linked
    cache_key = content_key("pch", includes, target=target_key, toolchain=(identity, compile_flags))
    cache = DiskCache()
    hit = cache.get("pch", cache_key)
    if hit is not None and _unchanged(json.loads(hit["headers.json"])):
        return _private(includes, hit["header.gch"])
    build = scratch.build_folder("pch")
    try:
        header = build / HEADER_NAME
        header.write_text(includes)
        out = build / (HEADER_NAME + ".gch")
        deps = build / "deps.d"
        cmd = [cxx, *compile_flags, "-x", "c++-header", str(header), "-o", str(out), "-MD", "-MF", str(deps)]
        returncode, stderr = _run(cmd)
        if returncode != 0 or not out.exists():
            log.artifact("cache", "no precompiled C++ header", f"{cxx} exited {returncode}: {stderr.strip()[:500]}")
            return None
        read = _stamps(_dependencies(deps.read_text(), header))
        data = out.read_bytes()
        cache.put("pch", cache_key, {"header.gch": data, "headers.json": json.dumps(read).encode()})
        return _private(includes, data)
    finally:
        shutil.rmtree(build, ignore_errors=True)


def _run(cmd: list[str]) -> tuple[int, str]:
    """Run g++, which the process's exit stops: a daemon thread is abandoned at exit, its child would
    not be."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    with _lock:
        _running.add(proc)
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
    with _lock:
        for proc in _running:
            proc.kill()


def _private(includes: str, gch: bytes) -> Path:
    """The header and its precompiled form, written to a new folder of this process's private folder."""
    folder = scratch.build_folder("pch-use")
    (folder / (HEADER_NAME + ".gch")).write_bytes(gch)
    header = folder / HEADER_NAME
    header.write_text(includes)
    return header


def _dependencies(make_rule: str, header: Path) -> list[str]:
    """The files a `-MD` rule names, the header itself left out."""
    body = make_rule.replace("\\\n", " ").split(":", 1)[1]
    return [p for p in body.split() if Path(p).name != HEADER_NAME or Path(p).parent != header.parent]


def _stamps(paths: list[str]) -> dict[str, list[int]]:
    out = {}
    for p in paths:
        st = os.stat(p)
        out[os.path.realpath(p)] = [st.st_size, st.st_mtime_ns]
    return out


def _unchanged(stamps: dict[str, list[int]]) -> bool:
    """Whether every header file the precompiled header read is as it was when it was built."""
    try:
        return all([(st := os.stat(p)).st_size, st.st_mtime_ns] == list(stamp) for p, stamp in stamps.items()) and bool(
            stamps
        )
    except OSError:
        return False


def wait(timeout: float = 120.0) -> None:
    """Wait for the header builds this process started to end (ready or not)."""
    with _lock:
        threads = list(_threads)
    for thread in threads:
        thread.join(timeout)
