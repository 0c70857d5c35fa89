"""One file that carries ember's disk cache to another machine: `ember cache export FILE` and
`ember cache import FILE` (`ember.save_cache(path)`, `ember.load_cache(path)`).

The file holds every entry of the cache (schedules, Triton kernel modules, cubins, launch records,
distinct kernels' records, C++ libraries, GEMM timings, vouchers of AOTAutograd entries:
runtime/cache.py's kinds, but for the facts measured on this machine's CPU), each with
its files' SHA-256, AOTAutograd's entries of ember's graphs with the cache's name for them
(frontend/cache_file.py adds and installs those), and the identity of what made them (`identity()`:
ember's source, the Python, torch and Triton versions, the GPU or CPU). Layout:

    MAGIC (12 bytes) | SHA-256 of the rest (32 bytes) | header length (8 bytes, little-endian)
    | header (JSON) | the files' bytes, one after another

Import checks the file for damage and mismatch (not for malice: see below). Before anything is written
it checks, in this order:
the magic, the whole file's checksum, the header's shape (every kind one of ember's, every key
and file name of the cache's own form, every span inside the file), each file's checksum, and the
identity, which must equal this process's: a file made by another torch, Triton, GPU or ember is
a clean miss, refused with a message that says which part differs. Nothing in it is unpickled or
loaded at import; a refused file writes nothing and removes nothing. Entries are then written
through DiskCache.put (atomic, with the cache's own manifest), so from there on they are checked
as every entry is; an entry already present is kept.

Importing a file trusts its author: what an imported entry holds runs when it is used, as a wheel's
code does (kernel modules, libraries, cubins), and torch unpickles the AOTAutograd entries it carries
when it looks them up. Import only files you made or trust: the file's checksum proves it is whole,
not who made it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from ember.runtime.cache import KINDS, MACHINE_KINDS, MANIFEST, DiskCache, ember_source_digest
from ember.runtime.safe_fs import open_folder, open_root

MAGIC = b"EMBERCACHE1\n"
FORMAT = 1
_KEY = re.compile(r"[0-9a-f]{64}")
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
# An AOTAutograd entry's file: <its key>/<its content's hash>, as torch names them.
_AOT_FILE = re.compile(r"[A-Za-z0-9_-]{1,128}/[A-Za-z0-9_-]{1,128}")


class CacheFileError(ValueError):
    """An imported file that is refused: damaged, not ember's, or made for another setup."""


@dataclass(frozen=True)
class Summary:
    entries: int
    files: int
    bytes: int


def identity() -> dict[str, str]:
    """What a cache file's entries were made with and for: a file made with any other is a miss."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        device = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    else:
        device = f"cpu {platform.machine()}"
    return {
        "ember": ember_source_digest(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton_version,
        "device": device,
    }


def _entries(cache: DiskCache) -> list[tuple[str, str, dict[str, bytes]]]:
    """(kind, key, files) of every intact entry of the cache, read through its checks."""
    found = []
    try:
        with open_root(cache.root, create=False) as (root, _):
            kinds = sorted((KINDS - MACHINE_KINDS) & set(os.listdir(root)))
            for kind in kinds:
                with open_folder(root, kind, str(cache.root / kind)) as kind_fd:
                    keys = []
                    for prefix in sorted(os.listdir(kind_fd)):
                        with open_folder(kind_fd, prefix, str(cache.root / kind / prefix)) as prefix_fd:
                            keys += [k for k in sorted(os.listdir(prefix_fd)) if _KEY.fullmatch(k)]
                for key in keys:
                    entry = cache.get(kind, key)
                    if entry is not None:
                        found.append((kind, key, dict(entry.files)))
    except FileNotFoundError:
        return []
    return found


def export_cache(path: str | Path, cache: DiskCache | None = None, aot: tuple[bytes, dict] | None = None) -> Summary:
    """Write every intact entry of `cache` (default: the setting `cache_dir`'s) to the file `path`.
    `aot`: (the cache's aot-id, {path under AOTAutograd's folder: bytes}), AOTAutograd's entries
    (frontend/cache_file.py), carried as they are."""
    cache = cache or DiskCache()
    header: dict = {"format": FORMAT, "identity": identity(), "entries": []}
    chunks, offset = [], 0
    if aot is not None and aot[1]:
        spans = {}
        for name, data in sorted(aot[1].items()):
            spans[name] = [offset, len(data), hashlib.sha256(data).hexdigest()]
            chunks.append(data)
            offset += len(data)
        header["aot"] = {"id": aot[0].hex(), "files": spans}
    for kind, key, files in _entries(cache):
        spans = {}
        for name, data in sorted(files.items()):
            spans[name] = [offset, len(data), hashlib.sha256(data).hexdigest()]
            chunks.append(data)
            offset += len(data)
        header["entries"].append({"kind": kind, "key": key, "files": spans})
    head = json.dumps(header, sort_keys=True).encode()
    body = struct.pack("<Q", len(head)) + head + b"".join(chunks)
    tmp = Path(f"{path}.tmp-{os.getpid()}")
    tmp.write_bytes(MAGIC + hashlib.sha256(body).digest() + body)
    os.replace(tmp, path)
    n = len(header["entries"])
    return Summary(n, sum(len(e["files"]) for e in header["entries"]), offset)


def read_cache_file(path: str | Path) -> tuple[dict, list[tuple[str, str, dict[str, bytes]]]]:
    """The header and the entries of a cache file, every check of the module's docstring passed
    but the identity's; raises CacheFileError saying what is wrong."""
    data = Path(path).read_bytes()
    if not data.startswith(MAGIC):
        raise CacheFileError(f"{path} is not an ember cache file (it does not start with ember's marker)")
    digest, body = data[len(MAGIC) : len(MAGIC) + 32], data[len(MAGIC) + 32 :]
    if len(body) < 8 or hashlib.sha256(body).digest() != digest:
        raise CacheFileError(f"{path} is damaged or was altered: its checksum does not match its contents")
    (size,) = struct.unpack("<Q", body[:8])
    try:
        header = json.loads(body[8 : 8 + size])
    except (ValueError, RecursionError):
        raise CacheFileError(f"{path}: its header is not valid JSON") from None
    payload = body[8 + size :]
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise CacheFileError(
            f"{path}: format {header.get('format') if isinstance(header, dict) else '?'}, not {FORMAT}"
        )
    entries = []
    if not isinstance(header.get("entries"), list):
        raise CacheFileError(f"{path}: its header lists no entries")
    for e in header["entries"]:
        if not isinstance(e, dict) or e.get("kind") not in KINDS or not _KEY.fullmatch(str(e.get("key"))):
            raise CacheFileError(f"{path}: an entry is not one of ember's ({str(e)[:120]})")
        files = {}
        spans = e.get("files")
        if not isinstance(spans, dict) or not spans:
            raise CacheFileError(f"{path}: entry {e['kind']}/{e['key']} lists no files")
        for name, span in spans.items():
            if not _FILE.fullmatch(name) or name == MANIFEST or not _is_span(span, len(payload)):
                raise CacheFileError(f"{path}: entry {e['kind']}/{e['key']} has a bad file record {name!r}")
            start, length, sha = span
            blob = payload[start : start + length]
            if hashlib.sha256(blob).hexdigest() != sha:
                raise CacheFileError(f"{path}: {e['kind']}/{e['key']}/{name} does not match its checksum")
            files[name] = blob
        entries.append((e["kind"], e["key"], files))
    header["aot_files"] = _aot_files(path, header.get("aot"), payload)
    return header, entries


def _aot_files(path, aot, payload: bytes) -> dict[str, bytes]:
    """The checked files of the header's AOTAutograd section ({} where there is none)."""
    if aot is None:
        return {}
    if not isinstance(aot, dict) or not re.fullmatch(r"[0-9a-f]{32}", str(aot.get("id"))):
        raise CacheFileError(f"{path}: its AOTAutograd section is not ember's")
    files = {}
    if not isinstance(aot.get("files"), dict):
        raise CacheFileError(f"{path}: its AOTAutograd section lists no files")
    for name, span in aot["files"].items():
        if not isinstance(name, str) or not _AOT_FILE.fullmatch(name) or not _is_span(span, len(payload)):
            raise CacheFileError(f"{path}: a bad AOTAutograd file record {str(name)[:80]!r}")
        blob = payload[span[0] : span[0] + span[1]]
        if hashlib.sha256(blob).hexdigest() != span[2]:
            raise CacheFileError(f"{path}: AOTAutograd's {name} does not match its checksum")
        files[name] = blob
    return files


def _is_span(span, size: int) -> bool:
    return (
        isinstance(span, list)
        and len(span) == 3
        and all(isinstance(v, int) and v >= 0 for v in span[:2])
        and span[0] + span[1] <= size
        and isinstance(span[2], str)
        and bool(_KEY.fullmatch(span[2]))
    )


def import_cache(path: str | Path, cache: DiskCache | None = None, install_aot=None) -> Summary:
    """Check the file `path` (see the module's docstring), then write its entries into `cache`
    (default: the setting `cache_dir`'s). Raises CacheFileError, writing nothing, if it is refused.
    `install_aot(aot_id, files)`: writes the AOTAutograd entries the file carries, once ember's are
    written (frontend/cache_file.py); None leaves them out."""
    cache = cache or DiskCache()
    header, entries = read_cache_file(path)
    mine = identity()
    theirs = header.get("identity") if isinstance(header.get("identity"), dict) else {}
    differ = [f"{k}: {theirs.get(k)!r} in the file, {v!r} here" for k, v in mine.items() if theirs.get(k) != v]
    if differ:
        shown = "; ".join(
            d if not d.startswith("ember:") else "ember: another version of ember's source" for d in differ
        )
        raise CacheFileError(
            f"{path} was made for another setup, so none of it would be used ({shown}); nothing imported"
        )
    if not cache.usable():
        raise CacheFileError(f"the disk cache {cache.root} cannot be written; nothing imported")
    for kind, key, files in entries:
        cache.put(kind, key, files)  # an intact entry already there is kept
    if install_aot is not None and header["aot_files"]:
        install_aot(bytes.fromhex(header["aot"]["id"]), header["aot_files"])
    return Summary(
        len(entries), sum(len(f) for _, _, f in entries), sum(len(b) for _, _, f in entries for b in f.values())
    )
