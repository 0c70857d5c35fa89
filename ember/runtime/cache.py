"""On-disk cache of generated source and binaries, addressed by content.

Layout: <cache_dir>/<kind>/<key[:2]>/<key>/ holding the artifact files and a manifest with
each file's SHA-256. Entries are written to a temporary directory and renamed into place
(atomic: a reader sees a whole entry or none; two writers of one key both succeed). A reader
trusts an entry only if the directory is owned by this user, the manifest lists exactly the
files present, and every checksum matches;
anything else is treated as a miss and rebuilt. The cache root is created 0700: loading a
cached shared library runs its code, so other users must not be able to plant one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ember import config, log

MANIFEST = "manifest.json"


def content_key(*parts: object) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(repr(p).encode() if not isinstance(p, (bytes, str)) else (p.encode() if isinstance(p, str) else p))
        h.update(b"\0")
    return h.hexdigest()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class DiskCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root or config.get("cache_dir"))

    def _ensure_root(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        st = self.root.stat()
        if st.st_uid != os.getuid():
            raise PermissionError(f"ember cache {self.root} is not owned by this user")
        if st.st_mode & 0o077:
            os.chmod(self.root, 0o700)

    def usable(self) -> bool:
        """Whether this cache can be read and written: its root is, or can be made, ours."""
        try:
            self._ensure_root()
        except OSError:  # PermissionError included: another user's cache
            return False
        return True

    def entry(self, kind: str, key: str) -> Path:
        return self.root / kind / key[:2] / key

    def get(self, kind: str, key: str) -> Path | None:
        """The entry's directory if it is present, ours, and intact; else None."""
        if not config.get("cache"):
            return None
        path = self.entry(kind, key)
        manifest = path / MANIFEST
        try:
            if path.stat().st_uid != os.getuid():
                log.artifact("cache", "reject", f"{path} is not owned by this user")
                return None
            files = json.loads(manifest.read_text())
            present = {p.name for p in path.iterdir()} - {MANIFEST}
            if not isinstance(files, dict) or set(files) != present:
                # A file the manifest does not vouch for (or a missing one) is damage too.
                log.artifact("cache", "reject", f"{path}: the manifest does not list exactly {sorted(present)}")
                return None
            for name, digest in files.items():
                if _sha256(path / name) != digest:
                    log.artifact("cache", "reject", f"{path / name}: checksum mismatch")
                    return None
        except (OSError, ValueError):
            return None
        log.artifact("cache", "hit", str(path))
        return path

    def put(self, kind: str, key: str, files: dict[str, bytes]) -> Path:
        """Write an entry atomically; returns its directory (an intact existing one wins a race)."""
        self._ensure_root()
        final = self.entry(kind, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=".tmp-"))
        try:
            for name, data in files.items():
                (tmp / name).write_bytes(data)
            manifest = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
            (tmp / MANIFEST).write_text(json.dumps(manifest))
            if final.exists():
                # A corrupt entry is replaced; an intact one (another process won) is kept.
                if self.get(kind, key) is not None:
                    return final
                shutil.rmtree(final, ignore_errors=True)
            try:
                os.replace(tmp, final)
            except OSError:
                if self.get(kind, key) is None:
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        log.artifact("cache", "write", str(final))
        return final
