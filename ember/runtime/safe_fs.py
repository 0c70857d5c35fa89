"""Folders and files opened so that what is checked is what is used: the disk cache's file access.

Every folder below a trusted folder and every file in one is opened relative to its parent's
descriptor with O_NOFOLLOW (a symbolic link at any level is refused, not followed), and checked
through `fstat` of that descriptor: a folder must be this user's and writable by no one else, a
file this user's and regular. The folder above a trusted root is opened by path (it may be a
link, as ~/.cache often is): what makes a folder's contents trustworthy is that only this user
can write into it, and that is checked on the folder itself.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted under a trusted name must not hang; regular files ignore it.
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class UnsafePath(PermissionError):
    """A folder or file that must not be trusted: a symbolic link, another user's, or writable by others."""


def _refusal(e: OSError, parent: int, name: str, path: str) -> OSError:
    """The error for a failed open of `name` in `parent`: UnsafePath for a link or a non-folder."""
    if e.errno in (errno.ELOOP, errno.EMLINK, errno.ENOTDIR):
        # O_NOFOLLOW on a link fails with ELOOP, or with ENOTDIR where a folder was asked for.
        try:
            is_link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
        except OSError:
            is_link = False
        return UnsafePath(f"{path} is a symbolic link" if is_link else f"{path} is not a folder")
    return e


def check_folder(fd: int, path: str) -> os.stat_result:
    """Raise UnsafePath unless the open folder `fd` is this user's and writable by no one else."""
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafePath(f"{path} is not a folder")
    if st.st_uid != os.geteuid():
        raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafePath(f"{path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o})")
    return st


@contextlib.contextmanager
def open_root(root: Path, create: bool) -> Iterator[tuple[int, bool]]:
    """(descriptor of the trusted folder `root`, whether this call created it). `create`: make it
    (0700) and the folders above it where missing. Raises UnsafePath for a root not to be trusted,
    FileNotFoundError for a missing one that is not to be created."""
    root = Path(os.path.abspath(root))
    if create:
        os.makedirs(root.parent, exist_ok=True)
    parent = os.open(root.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        created = False
        if create:
            try:
                os.mkdir(root.name, 0o700, dir_fd=parent)
                created = True
            except FileExistsError:
                pass
        try:
            fd = os.open(root.name, _DIR, dir_fd=parent)
        except OSError as e:
            raise _refusal(e, parent, root.name, str(root)) from None
    finally:
        os.close(parent)
    try:
        check_folder(fd, str(root))
        yield fd, created
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_folder(parent: int, name: str, path: str, create: bool = False) -> Iterator[int]:
    """The trusted folder `name` in the open trusted folder `parent` (`path`: its name in messages)."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=parent)
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except OSError as e:
        raise _refusal(e, parent, name, path) from None
    try:
        check_folder(fd, path)
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def open_file(folder: int, name: str, path: str) -> Iterator[int]:
    """The regular file `name`, this user's, in the open trusted folder `folder`, opened for reading."""
    try:
        fd = os.open(name, _FILE, dir_fd=folder)
    except OSError as e:
        raise _refusal(e, folder, name, path) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePath(f"{path} is not a regular file")
        if st.st_uid != os.geteuid():
            raise UnsafePath(f"{path} belongs to uid {st.st_uid}, not to this user")
        yield fd
    finally:
        os.close(fd)


def read_all(fd: int) -> bytes:
    """Everything left to read from `fd`."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def read_file(folder: int, name: str, path: str) -> bytes:
    with open_file(folder, name, path) as fd:
        return read_all(fd)


def write_new(folder: int, name: str, data: bytes, mode: int = 0o600) -> None:
    """Create the file `name` in `folder` (it must not exist: O_EXCL, no link followed) holding `data`."""
    fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=folder)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def remove_tree(parent: int, name: str) -> None:
    """Remove `name` from `parent` and, if it is a folder, all below it, without following a link.
    What is already gone (another process removing the same tree) is skipped."""
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent)
        return
    try:
        for child in os.listdir(fd):
            remove_tree(fd, child)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=parent)
    except FileNotFoundError:
        pass
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:  # another process is still removing it, or adding to it
            raise
