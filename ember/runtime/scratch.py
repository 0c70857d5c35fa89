"""A private folder per process for what has to be a file but is not a cache entry.

The C++ compiler writes its source and library into it (`build_folder`), and a verified cache entry
that must be loaded from a path (a shared library for dlopen, a cubin for the CUDA driver, kernel
source that Triton reads back through `inspect`) is written there as a private copy
(`private_copy`): what is loaded is then the very bytes the cache checked, whatever happens to the
entry's path meanwhile. It is also where graphs compile when the disk cache is off or unusable.

The folder is `ember-<pid>-<random>` in the system's temporary folder (`TMPDIR`), made by
`tempfile.mkdtemp` (0700, this user's) on first use and removed at exit. A process killed before
its exit handlers ran leaves its folder behind; the next process to make one removes every such
folder of this user's whose process is gone and which was last changed more than
`STALE_SECONDS` ago (the age guards against a process of another PID namespace sharing the folder).
Libraries are mapped from this folder, so `TMPDIR` must allow executable mappings (as for
Inductor, whose libraries live in /tmp/torchinductor_<user>).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib.util
import itertools
import os
import re
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path

from ember.runtime.safe_fs import write_new

PREFIX = "ember-"
STALE_SECONDS = 15 * 60
_NAME = re.compile(rf"{re.escape(PREFIX)}(\d+)-")

_lock = threading.Lock()
_import_lock = threading.Lock()  # import_private_copy's
_folder: Path | None = None
_owner_pid = -1
_counter = itertools.count()


def folder() -> Path:
    """This process's private folder (made, and stale ones swept, on first use; made again if removed)."""
    global _folder, _owner_pid
    with _lock:
        if _folder is None or _owner_pid != os.getpid() or not _folder.is_dir():
            base = Path(tempfile.gettempdir())
            sweep(base)
            _folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
            _owner_pid = os.getpid()
            atexit.register(_remove_at_exit, _folder, _owner_pid)
        return _folder


def _remove_at_exit(path: Path, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked child, whose parent still uses it
        shutil.rmtree(path, ignore_errors=True)


def unique_name(stem: str) -> str:
    """A name never used before in this process's folder: dlopen returns an already loaded library
    for a path it has seen, so two libraries must never share one."""
    return f"{next(_counter)}-{stem}"


def build_folder(stem: str) -> Path:
    """A new empty folder, this process's, for one compiler run."""
    path = folder() / unique_name(stem)
    path.mkdir(mode=0o700)
    return path


def private_copy(data: bytes, name: str) -> Path:
    """`data` written to a new file of this process's folder; the path of that file."""
    base = folder()
    unique = unique_name(name)
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        write_new(fd, unique, data)
    finally:
        os.close(fd)
    return base / unique


def import_private_copy(data: bytes, name: str):
    """The Python module `name` made from `data` (checked bytes, e.g. a cache entry's kernel module):
    imported once per process from a private copy, never from the cache's file. Triton reads each
    kernel's source back through `inspect`, and compile workers import the module by path."""
    with _import_lock:  # no thread sees the module before it has run, nor one whose run failed
        module = sys.modules.get(name)
        if module is None:
            spec = importlib.util.spec_from_file_location(name, private_copy(data, f"{name}.py"))
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
    return module


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process holds the number
    return True


def sweep(base: Path, stale_seconds: float = STALE_SECONDS) -> list[Path]:
    """Remove the private folders in `base` left by this user's processes that are gone; returns them."""
    removed = []
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(base):
            match = _NAME.match(entry.name)
            if match is None or int(match.group(1)) == os.getpid():
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or now - st.st_mtime < stale_seconds:
                continue
            if _alive(int(match.group(1))):
                continue
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(Path(entry.path))
    return removed
