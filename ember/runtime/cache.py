"""ember's cache layer: the key of everything ember caches, and the disk cache that stores it.

Keys. Every cached thing is keyed by `content_key`, one recipe: a SHA-256 over the entry's kind,
what it is made from (a graph, a kernel module's source, a binary's bytes), the target it was made
for, the toolchain that made it, and, for what ember's own passes make, ember's identity
(`ember_identity`: the settings marked `codegen` in config.py, the one list of settings that enter
keys; ember's source; the Python, torch and sympy versions). Its users: a graph's schedule
(runtime/schedule_cache.py), a Triton kernel module, its cubins and launch records
(backends/triton.py, backends/static_launch.py), a distinct kernel's launch record
(backends/kernel_dedup.py), a C++ library (backends/cpp.py), GEMM timings
(backends/gemm_tuning.py), what was measured of this machine (backends/device.py: its bandwidth;
backends/cpu_products.py: the CPU's product times by shape), and ember's part of
AOTAutograd's key (frontend/aot_cache.py).

Layout, under the root (setting `cache_dir`):

    CACHEDIR.TAG                    written when ember creates the root: the folder is ember's
    <kind>/<key[:2]>/<key>/         one entry: its files and manifest.json (each file's SHA-256)
    aot-key                         a random key (frontend/aot_cache.py signs with it), 0600
    aot-id                          a random name of this cache's AOTAutograd entries (their key's tag), 0600
    .trash-*                        entries on their way out (evicted, replaced or cleared)

Trust. Loading a cached binary or unpickling a cached schedule runs its code, so an entry is
used only if nobody but this user could have written it. The root and every folder below it
must be this user's and writable by no one else, and no level may be a symbolic link: each is
opened relative to its parent's descriptor with O_NOFOLLOW and checked through that descriptor
(runtime/safe_fs.py). `get` reads each file once, through the descriptor it checked, compares
its SHA-256 with the manifest (which must list exactly the files present), and returns those
bytes (`Entry`); nothing reopens an entry by path afterwards, so replacing a file after the
check changes nothing. Whatever must be loaded from a path is loaded from a private copy of
these bytes (runtime/scratch.py). A damaged entry is a miss, and the next `put` replaces it.

A root that cannot be trusted (another user's, writable by others, a symbolic link, not a
folder) is not used: every `get` misses, `put` writes nothing, and one warning says why and what
to do. ember never changes the permissions of a folder it did not create; it creates the root
0700. A `put` that fails (a full disk, a read-only folder) warns once; either way the compile
goes on with the entry's bytes in memory. With the setting `cache` off nothing is read or written.

Writes are atomic: an entry is written into a temporary folder next to its place and renamed
into it, so a reader sees a whole entry or none, and of two writers of one key the first wins.

Size. Each hit stamps its manifest's access time. After a `put` has written a tenth of the bound
(setting `cache_max_mb`) since this process last looked, or on its first `put`, the entries are
summed and, past the bound, the least recently used are removed until a tenth is free. Removal
renames an entry out of its place before deleting its files, so a reader never sees part of one.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import platform
import re
import secrets
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from ember import config, faults, log
from ember.runtime.safe_fs import (
    UnsafePath,
    open_file,
    open_folder,
    open_root,
    read_all,
    read_file,
    remove_tree,
    write_new,
)

MANIFEST = "manifest.json"
MARKER = "CACHEDIR.TAG"
# The cache-directory tag of https://bford.info/cachedir/ (backup tools skip the folder), naming ember.
MARKER_TEXT = (
    b"Signature: 8a477f597d28d172789f06886806bc55\n"
    b"# This folder is ember's disk cache; `ember cache clear` empties it.\n"
)
# Every kind of entry ember writes, and the root's other files of ember's: what `clear` removes.
KINDS = frozenset(
    {"cpp", "pch", "triton", "schedule", "cubin", "launch", "kernel", "gemm", "tuning", "vouch", "device", "model"}
)
# Kinds that describe this machine (a CPU's measured bandwidth and product times; g++'s precompiled
# headers, which hold this machine's header files): a cache file does not carry them. A GPU model's
# measured bandwidth (kind "model") it does.
MACHINE_KINDS = frozenset({"device", "pch"})
SECRETS = frozenset({"aot-key", "aot-id"})
TMP = ".tmp-"
TRASH = ".trash-"
# A temporary or trash folder older than this was left by a process that died writing or removing it.
STALE_TMP_SECONDS = 3600
_NAME = re.compile(r"[0-9A-Za-z_-]+")


def content_key(
    kind: str, *content: object, target: object = None, toolchain: object = None, ember: bool = False
) -> str:
    """The key of a cached thing of `kind` (a DiskCache kind, or "aot" for AOTAutograd's entries).

    `content`: what it is made from. `target`: what it was made for, ember/target.py's Target.key()
    (what the passes are told, and what binaries are built for: Triton's GPU target, the host CPU);
    the one place where a target's identity enters a key. `toolchain`: the compiler that made it, as
    its backend names it (`triton_identity`; the C++ compiler's version and flags). `ember`:
    whether ember's passes made it, so that `ember_identity` enters too. Each part is hashed with
    its type and length, so no two different lists of parts hash the same bytes."""
    h = hashlib.sha256()
    for part in (kind, len(content), *content, target, toolchain, ember_identity() if ember else None):
        h.update(_framed(part))
    return h.hexdigest()


def _framed(part: object) -> bytes:
    """`part` as bytes that say its type (bytes, text, or any other value by its repr) and length."""
    if isinstance(part, bytes):
        return b"b" + len(part).to_bytes(8, "little") + part
    data = part.encode() if isinstance(part, str) else repr(part).encode()
    return (b"s" if isinstance(part, str) else b"r") + len(data).to_bytes(8, "little") + data


def ember_identity() -> tuple:
    """What of ember the things its passes make depend on: the settings that change generated code
    (config.codegen_key: every setting marked `codegen`), ember's own source, and the Python, torch
    and sympy versions."""
    import sympy
    import torch

    settings = tuple(sorted(config.codegen_key().items()))
    return settings, ember_source_digest(), platform.python_version(), torch.__version__, sympy.__version__


@functools.cache
def ember_source_digest() -> str:
    """SHA-256 of every module of ember's, with its path: any change to ember's code is another key."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(_framed(str(path.relative_to(root))) + _framed(path.read_bytes()))
    return h.hexdigest()


# Triton variables that say where files go or how its cache is kept, not what a binary holds: a
# cache imported on a machine whose Triton cache lives elsewhere must still find its kernels. (With
# TRITON_KERNEL_OVERRIDE on, TRITON_HOME names where override files are read: then it stays.)
_TRITON_LOCATIONS = frozenset(
    {"TRITON_CACHE_DIR", "TRITON_HOME", "TRITON_DUMP_DIR", "TRITON_CACHE_MANAGER", "TRITON_REMOTE_CACHE_BACKEND"}
)
# Variables outside those prefixes that change what Triton builds (its own list is read where it
# has one: triton._C.libtriton.get_cache_invalidating_env_vars).
_BINARY_STEERING = frozenset(
    {"PTXAS_OPTIONS", "DISABLE_MMA_V3", "DISABLE_MMA_V5", "DISABLE_PTXAS_OPT", "DISABLE_LLVM_OPT"}
)


def _triton_invalidating() -> frozenset:
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        return _BINARY_STEERING | frozenset(get_cache_invalidating_env_vars())
    except (ImportError, AttributeError, TypeError):
        return _BINARY_STEERING


def triton_identity() -> tuple:
    """What picks the binary Triton makes of a source besides the source and the GPU: Triton's
    version and the environment variables that steer its passes and its compilers' (TRITON_*,
    MLIR_*, LLVM_* but those naming only places, _TRITON_LOCATIONS; and Triton's own list)."""
    import triton

    places = _TRITON_LOCATIONS - ({"TRITON_HOME"} if os.environ.get("TRITON_KERNEL_OVERRIDE") else set())
    invalidating = _triton_invalidating()
    steering = tuple(
        sorted(
            (k, v)
            for k, v in os.environ.items()
            if (k.startswith(("TRITON_", "MLIR_", "LLVM_")) and k not in places) or k in invalidating
        )
    )
    return triton.__version__, steering


@dataclass(frozen=True)
class Entry:
    """One cache entry: where it lives (for messages only: never reopened) and its files' bytes,
    as checked against its manifest (or as just written)."""

    path: Path
    files: Mapping[str, bytes] = field(repr=False)

    def __getitem__(self, name: str) -> bytes:
        return self.files[name]


def _swap_checked(entry: Entry) -> None:
    """Setting `fault_inject=cache_swap=PATH` (a testing aid): the entry's file named as PATH's is
    overwritten with PATH's bytes, after the check, as a swap between the check and the use would."""
    swap = faults.armed("cache_swap")
    if swap and Path(swap).name in entry.files:
        (entry.path / Path(swap).name).write_bytes(Path(swap).read_bytes())


class NotEmberCache(Exception):
    """`clear` refused: the folder is not one that ember made, or cannot be trusted."""


_lock = threading.Lock()
_warned: set[str] = set()  # roots this process has warned about
_written: dict[str, int] = {}  # per root: bytes this process wrote since it last summed the entries


class DiskCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root or config.get("cache_dir"))

    def entry(self, kind: str, key: str) -> Path:
        if kind not in KINDS or not _NAME.fullmatch(key) or len(key) < 3:
            raise ValueError(f"not a cache entry: kind {kind!r}, key {key!r}")
        return self.root / kind / key[:2] / key

    # -- reading ------------------------------------------------------------------------------

    def get(self, kind: str, key: str) -> Entry | None:
        """The entry's verified files if it is present, trusted and intact; else None."""
        path = self.entry(kind, key)
        if not config.get("cache"):
            return None
        try:
            with open_root(self.root, create=False) as (root, _):
                try:
                    with (
                        open_folder(root, kind, str(self.root / kind)) as kind_fd,
                        open_folder(kind_fd, key[:2], str(path.parent)) as prefix,
                        open_folder(prefix, key, str(path)) as folder,
                    ):
                        found = self._verified(folder, path)
                except UnsafePath as e:
                    self._warn_once(
                        f"ember: the disk cache {self.root} holds what it must not trust, and skips it: {e}. "
                        "`ember cache clear` empties the cache."
                    )
                    return None
        except FileNotFoundError:
            return None
        except OSError as e:  # UnsafePath included: the root itself
            self._refused(e)
            return None
        if found is not None:
            log.artifact("cache", "hit", str(path))
            _swap_checked(found)
        return found

    def _verified(self, folder: int, path: Path) -> Entry | None:
        """The entry in the open folder, if its manifest lists exactly its files and every checksum
        matches; stamps its use."""
        try:
            with open_file(folder, MANIFEST, str(path / MANIFEST)) as manifest_fd:
                manifest = json.loads(read_all(manifest_fd))
                present = set(os.listdir(folder)) - {MANIFEST}
                if not isinstance(manifest, dict) or set(manifest) != present:
                    # A file the manifest does not vouch for (or a missing one) is damage too.
                    log.artifact("cache", "reject", f"{path}: the manifest does not list exactly {sorted(present)}")
                    return None
                files = {}
                for name, digest in manifest.items():
                    data = read_file(folder, name, str(path / name))
                    if hashlib.sha256(data).hexdigest() != digest:
                        log.artifact("cache", "reject", f"{path / name}: checksum mismatch")
                        return None
                    files[name] = data
                _stamp(manifest_fd)
        except FileNotFoundError:
            log.artifact("cache", "reject", f"{path}: a file is missing")
            return None
        except ValueError:
            log.artifact("cache", "reject", f"{path / MANIFEST}: not a manifest")
            return None
        return Entry(path, files)

    # -- writing ------------------------------------------------------------------------------

    def put(self, kind: str, key: str, files: dict[str, bytes]) -> Entry:
        """Write an entry atomically (an intact entry already there wins a race); returns its files.
        Where the cache is off or cannot be written, nothing is written and `files` are returned."""
        mine = Entry(self.entry(kind, key), dict(files))
        if not config.get("cache"):
            return mine
        try:
            with open_root(self.root, create=True) as (root, created):
                if created:
                    _mark(root)
                entry = self._write(root, kind, key, mine)
                self._account(root, sum(len(data) for data in files.values()))
        except OSError as e:  # UnsafePath included
            self._refused(e, writing=True)
            return mine
        log.artifact("cache", "write", str(entry.path))
        return entry

    def _write(self, root: int, kind: str, key: str, mine: Entry) -> Entry:
        path = mine.path
        with (
            open_folder(root, kind, str(self.root / kind), create=True) as kind_fd,
            open_folder(kind_fd, key[:2], str(path.parent), create=True) as prefix,
        ):
            tmp = TMP + secrets.token_hex(8)
            os.mkdir(tmp, 0o700, dir_fd=prefix)
            try:
                with open_folder(prefix, tmp, str(path.parent / tmp)) as folder:
                    for name, data in mine.files.items():
                        write_new(folder, name, data)
                    digests = {name: hashlib.sha256(data).hexdigest() for name, data in mine.files.items()}
                    write_new(folder, MANIFEST, json.dumps(digests).encode())
                existing = self._intact_or_discarded(root, prefix, key, path)
                if existing is not None:
                    return existing  # another process wrote it first
                try:
                    os.rename(tmp, key, src_dir_fd=prefix, dst_dir_fd=prefix)
                except OSError:
                    existing = self._intact_or_discarded(root, prefix, key, path)
                    if existing is None:
                        raise
                    return existing
            finally:
                remove_tree(prefix, tmp)
        return mine

    def _intact_or_discarded(self, root: int, prefix: int, key: str, path: Path) -> Entry | None:
        """The intact entry at `key`; anything else there (damaged, a link, another user's) is
        moved out and removed, and None returned."""
        try:
            with open_folder(prefix, key, str(path)) as folder:
                intact = self._verified(folder, path)
        except FileNotFoundError:
            return None
        except UnsafePath as e:
            log.artifact("cache", "reject", str(e))
            intact = None
        if intact is None:
            _discard(root, prefix, key)
        return intact

    def _account(self, root: int, size: int) -> None:
        """Sum the entries and evict past the bound, if enough was written since this process last did."""
        bound = config.get("cache_max_mb") << 20
        if not bound:
            return
        with _lock:
            written = _written.get(str(self.root))
            due = written is None or written + size >= bound // 10
            _written[str(self.root)] = 0 if due else written + size
        if due:
            try:
                self._trim(root, bound)
            except OSError as e:  # the entry is written; a cache over its bound is not an error
                log.artifact("cache", "evict", f"{self.root}: not trimmed ({e})")

    # -- size ---------------------------------------------------------------------------------

    def trim(self, bound_bytes: int | None = None) -> list[Path]:
        """Evict least recently used entries until the cache holds at most 90% of `bound_bytes`
        (default: the setting `cache_max_mb`), if it holds more than `bound_bytes`; returns them."""
        bound = config.get("cache_max_mb") << 20 if bound_bytes is None else bound_bytes
        try:
            with open_root(self.root, create=False) as (root, _):
                return self._trim(root, bound)
        except FileNotFoundError:
            return []
        except OSError as e:
            self._refused(e)
            return []

    def _trim(self, root: int, bound: int) -> list[Path]:
        for name in os.listdir(root):
            if name.startswith(TRASH):  # left by a process that died while removing it
                _sweep_stale(root, name)
        entries = []  # (last use in ns, size, kind, prefix, key)
        for kind, prefix, prefix_fd in self._prefixes(root):
            for key in os.listdir(prefix_fd):
                if key.startswith(TMP):  # a write in progress, or a dead process's
                    _sweep_stale(prefix_fd, key)
                else:
                    entries.append((*_usage(prefix_fd, key), kind, prefix, key))
        total = sum(size for _, size, *_ in entries)
        if bound <= 0 or total <= bound:
            return []
        evicted = []
        for _, size, kind, prefix, key in sorted(entries):  # least recently used first
            if total <= bound - bound // 10:
                break
            with (
                contextlib.suppress(FileNotFoundError, UnsafePath),
                open_folder(root, kind, str(self.root / kind)) as kind_fd,
                open_folder(kind_fd, prefix, str(self.root / kind / prefix)) as prefix_fd,
            ):
                _discard(root, prefix_fd, key)
                total -= size
                evicted.append(self.root / kind / prefix / key)
        log.artifact("cache", "evict", lambda: "\n".join(map(str, evicted)))
        return evicted

    def _prefixes(self, root: int) -> Iterator[tuple[str, str, int]]:
        """(kind, prefix, the open prefix folder) of every entry's parent folder that can be trusted."""
        for kind in sorted(KINDS & set(os.listdir(root))):
            with (
                contextlib.suppress(FileNotFoundError, UnsafePath),
                open_folder(root, kind, str(self.root / kind)) as kind_fd,
            ):
                for prefix in os.listdir(kind_fd):
                    with (
                        contextlib.suppress(FileNotFoundError, UnsafePath),
                        open_folder(kind_fd, prefix, str(self.root / kind / prefix)) as prefix_fd,
                    ):
                        yield kind, prefix, prefix_fd

    # -- the root -----------------------------------------------------------------------------

    def usable(self) -> bool:
        """Whether this cache can be read and written: its root is, or can be made, trusted."""
        if not config.get("cache"):
            return False
        try:
            with open_root(self.root, create=True) as (root, created):
                if created:
                    _mark(root)
        except OSError as e:
            self._refused(e)
            return False
        return True

    def secret(self, name: str, size: int = 32) -> bytes | None:
        """The random secret `name` kept at the root (made on first use, 0600); None where the cache
        is off or cannot be trusted, or the file found there is not such a secret."""
        if name not in SECRETS:
            raise ValueError(f"not one of ember's secrets: {name!r}")
        if not config.get("cache"):
            return None
        path = str(self.root / name)
        try:
            with open_root(self.root, create=True) as (root, created):
                if created:
                    _mark(root)
                try:
                    return _read_or_make_secret(root, name, size, path)
                except OSError as e:  # UnsafePath included
                    self._warn_once(f"ember: {path} is not used as a key ({e}); remove it and ember makes a new one")
                    return None
        except OSError as e:
            self._refused(e)
            return None

    def replace_secret(self, name: str, data: bytes) -> None:
        """Put `data` in place of the secret `name` (atomically; a cache import adopts the AOTAutograd
        entries' name of the cache it came from). Raises OSError where the cache cannot be written."""
        if name not in SECRETS:
            raise ValueError(f"not one of ember's secrets: {name!r}")
        with open_root(self.root, create=True) as (root, created):
            if created:
                _mark(root)
            tmp = TMP + secrets.token_hex(8)
            write_new(root, tmp, data, 0o600)
            os.rename(tmp, name, src_dir_fd=root, dst_dir_fd=root)

    def clear(self) -> list[str]:
        """Remove every entry and secret from a cache that ember made (it has ember's marker);
        returns the names removed from the root. Raises NotEmberCache, removing nothing, for any
        other folder; FileNotFoundError where there is none."""
        try:
            with open_root(self.root, create=False) as (root, _):
                try:
                    marker = read_file(root, MARKER, str(self.root / MARKER))
                except (FileNotFoundError, UnsafePath):
                    marker = b""
                if marker != MARKER_TEXT:
                    raise NotEmberCache(
                        f"{self.root} has no {MARKER} written by ember, so it may not be ember's cache; "
                        "nothing was deleted. (A cache made by an older ember has none either: delete that "
                        "folder yourself.)"
                    )
                removed = []
                for name in sorted(os.listdir(root)):
                    if name in KINDS or name in SECRETS or name.startswith((TRASH, TMP)):
                        _discard(root, root, name)
                        removed.append(name)
                return removed
        except UnsafePath as e:
            raise NotEmberCache(f"{e}: not clearing it; nothing was deleted") from None

    def _refused(self, error: OSError, writing: bool = False) -> None:
        """One warning per root and process: the cache is not used (or not written), and why."""
        if isinstance(error, UnsafePath):
            message = (
                f"ember: the disk cache {self.root} is not used: {error}. Graphs compile without it. "
                "Point EMBER_CACHE_DIR at a folder that is yours and that only you can write (ember "
                "makes it if it is missing), or make this one so (its owner, chmod go-w), if it is yours."
            )
        elif writing:
            message = f"ember: could not write to the disk cache {self.root} ({error}); graphs still compile, uncached"
        else:
            message = f"ember: the disk cache {self.root} is not used ({error}); graphs still compile, uncached"
        self._warn_once(message)

    def _warn_once(self, message: str) -> None:
        log.artifact("cache", "reject", message)
        with _lock:
            if str(self.root) in _warned:
                return
            _warned.add(str(self.root))
        warnings.warn(message, stacklevel=4)


def _stamp(fd: int) -> None:
    """Record a use of an entry: its manifest's access time (modification time unchanged)."""
    with contextlib.suppress(OSError):  # a read-only cache is still read
        os.utime(fd, ns=(time.time_ns(), os.fstat(fd).st_mtime_ns))


def _sweep_stale(parent: int, name: str) -> None:
    """Remove a temporary or trash folder old enough that the process writing or removing it must
    have died."""
    with contextlib.suppress(FileNotFoundError):
        if time.time() - os.stat(name, dir_fd=parent, follow_symlinks=False).st_mtime > STALE_TMP_SECONDS:
            remove_tree(parent, name)


def _usage(prefix: int, key: str) -> tuple[int, int]:
    """(last use in ns, bytes) of the entry `key`: its manifest's access time, its files' sizes."""
    try:
        used, size = 0, 0
        with open_folder(prefix, key, key) as folder:
            for name in os.listdir(folder):
                file = os.stat(name, dir_fd=folder, follow_symlinks=False)
                size += file.st_size
                if name == MANIFEST:
                    used = file.st_atime_ns
        return used, size
    except (FileNotFoundError, UnsafePath):
        return 0, 0


def _discard(root: int, parent: int, name: str) -> None:
    """Move `name` out of `parent` into the root's trash, then remove it: whoever opened it before
    keeps what it read, and nobody finds part of it under its old name."""
    trash = TRASH + secrets.token_hex(8)
    try:
        os.rename(name, trash, src_dir_fd=parent, dst_dir_fd=root)
    except FileNotFoundError:
        return  # another process removed it first
    remove_tree(root, trash)


def _mark(root: int) -> None:
    with contextlib.suppress(FileExistsError):
        write_new(root, MARKER, MARKER_TEXT, 0o644)


def _read_or_make_secret(root: int, name: str, size: int, path: str) -> bytes:
    with contextlib.suppress(FileNotFoundError):
        return _read_secret(root, name, size, path)
    tmp = TMP + secrets.token_hex(8)
    write_new(root, tmp, secrets.token_bytes(size), 0o600)
    try:
        # A link is made only where no file of that name exists: of two processes making one at
        # once, the first one's secret is the one both use.
        os.link(tmp, name, src_dir_fd=root, dst_dir_fd=root, follow_symlinks=False)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp, dir_fd=root)
    return _read_secret(root, name, size, path)


def _read_secret(root: int, name: str, size: int, path: str) -> bytes:
    with open_file(root, name, path) as fd:
        mode = os.fstat(fd).st_mode
        data = read_all(fd)
    if mode & 0o077 or len(data) != size:
        raise UnsafePath(f"{path} is not a {size}-byte secret readable only by you (mode {mode & 0o777:o})")
    return data
