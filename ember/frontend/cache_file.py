"""`ember.save_cache` / `ember.load_cache` (`ember cache export|import FILE`): ember's disk cache and
AOTAutograd's entries of ember's graphs in one file, so that a new machine of the same kind starts
as warm as the one that made it.

runtime/portable.py writes and checks the file and ember's own entries. This module adds what
lives in torch's cache folder: AOTAutograd's entries of ember's graphs (frontend/aot_cache.py),
which hold a graph's traced forward and backward and ember's schedule, so that a first step skips
AOTAutograd's tracing too. They are read only from a torch folder that is this user's alone, and
only the files that name ember's `EmberGraphCode` (found by their bytes, not by unpickling them).

On import they go back into torch's folder (again only where it is this user's alone), after every
check of the file passed and ember's entries were written, and the cache adopts the exported cache's
name for its AOTAutograd entries (`aot-id`, part of their key), so that they are found; entries
this cache made before under its old name are simply not found again (compiled anew, then kept).
Each entry is still checked when AOTAutograd loads it: its schedule (ember's part) is unpickled only if
its signature matches this cache's key or the file vouched for it; torch unpickles the entry around it
first, so importing a file trusts its author. A voucher is a SHA-256 of what was signed, written into
ember's cache from the file (aot_cache._trusted).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from ember import log
from ember.frontend import aot_cache
from ember.runtime import portable
from ember.runtime.cache import TMP, DiskCache
from ember.runtime.safe_fs import UnsafePath, open_folder, open_root, read_file, write_new

AOT = "aotautograd"
# Bytes every pickled entry holding one of ember's graphs contains: the class's module name.
_EMBERS = aot_cache.EmberGraphCode.__module__.encode()


def _torch_folder() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def aot_entries() -> dict[str, bytes]:
    """{"<key>/<file>": bytes} of AOTAutograd's entries of ember's graphs in torch's folder; {} where
    there are none or the folder is not this user's alone."""
    root = _torch_folder()
    if not (root / AOT).is_dir() or not aot_cache._torch_cache_is_private():
        return {}
    found = {}
    try:
        with open_root(root, create=False) as (fd, _), open_folder(fd, AOT, str(root / AOT)) as aot:
            for key in sorted(os.listdir(aot)):
                with open_folder(aot, key, str(root / AOT / key)) as folder:
                    for name in sorted(os.listdir(folder)):
                        data = read_file(folder, name, str(root / AOT / key / name))
                        if _EMBERS in data:
                            found[f"{key}/{name}"] = data
    except (FileNotFoundError, UnsafePath) as e:
        log.warn(f"ember: AOTAutograd's entries not exported: {e}")
        return {}
    return found


def install_aot(aot_id: bytes, files: dict[str, bytes]) -> None:
    """Write checked AOTAutograd entries into torch's folder and adopt their cache's name."""
    root = _torch_folder()
    if not aot_cache._torch_cache_is_private():
        log.warn(f"ember: AOTAutograd's entries not imported: {root} is not yours alone")
        return
    with open_root(root, create=True) as (fd, _), open_folder(fd, AOT, str(root / AOT), create=True) as aot:
        for name, data in files.items():
            key, file = name.split("/")
            with open_folder(aot, key, str(root / AOT / key), create=True) as folder:
                tmp = TMP + secrets.token_hex(8)
                write_new(folder, tmp, data)
                os.rename(tmp, file, src_dir_fd=folder, dst_dir_fd=folder)
    DiskCache().replace_secret("aot-id", aot_id)


def save_cache(path: str | os.PathLike) -> portable.Summary:
    """Write ember's disk cache and AOTAutograd's entries of ember's graphs to the file `path`."""
    aot = aot_entries()
    name = aot_cache.aot_id() if aot else None
    return portable.export_cache(path, aot=(name, aot) if name else None)


def load_cache(path: str | os.PathLike) -> portable.Summary:
    """Check the file `path` and import it (see the module's docstring); raises portable.CacheFileError,
    importing nothing, for a damaged or foreign file."""
    return portable.import_cache(path, install_aot=install_aot)
