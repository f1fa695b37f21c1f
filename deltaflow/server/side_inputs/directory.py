"""One side input's directory in the shared warehouse: its lease, its versions and the
``CURRENT`` pointer, its last error. Every call blocks (the node runs them in worker threads).

Every file is written to a temporary name and moved into place with ``os.replace``, so a
reader sees a whole old file or a whole new one; every change of ``lease`` or ``CURRENT`` holds
the directory's ``lock`` (an flock).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from ...tables.flock import file_lock
from .version import Version

__all__ = ["Directory", "Lease", "LeaseLostError"]

#: Versions kept on disk: a reader that read ``CURRENT`` just before newer versions landed
#: still finds its file, unless several versions landed within one of its reads.
_KEEP_VERSIONS: Final = 4
#: The lock is held for a few small file operations; waiting longer means a stuck process.
_LOCK_TIMEOUT: Final = 10.0


@dataclass(frozen=True, slots=True)
class Lease:
    holder: str
    instance: str
    epoch: int
    expires: float
    last_run: float | None


class LeaseLostError(Exception):
    """This node no longer holds the lease it retrieved under; the value is not published."""


def _write_atomic(path: Path, data: bytes, *, fsync: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        value = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    return value if isinstance(value, dict) else None


class Directory:
    """One side input's directory in the warehouse. Every method blocks."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.lease_path = root / "lease"
        self.current_path = root / "CURRENT"
        self.error_path = root / "error"

    def version_path(self, version: int) -> Path:
        return self.root / f"v{version:08d}.bin"

    def _locked(self) -> contextlib.AbstractContextManager[float]:
        return file_lock(self.root / "lock", timeout=_LOCK_TIMEOUT, what="side-input lock")

    def read_lease(self) -> Lease | None:
        raw = _read_json(self.lease_path)
        if raw is None:
            return None
        last_run = raw.get("last_run")
        return Lease(
            holder=str(raw["holder"]),
            instance=str(raw["instance"]),
            epoch=int(raw["epoch"]),
            expires=float(raw["expires"]),
            last_run=None if last_run is None else float(last_run),
        )

    def _write_lease(self, lease: Lease) -> None:
        _write_atomic(self.lease_path, json.dumps(dataclasses.asdict(lease)).encode(), fsync=False)

    def try_lease(
        self, node_id: str, instance: str, duration: float, last_run: float | None
    ) -> tuple[bool, Lease | None]:
        """Take or renew the lease if it is free, expired or ours; (held, the lease now)."""
        with self._locked():
            now = time.time()
            current = self.read_lease()
            mine = current is not None and current.instance == instance
            if current is not None and not mine and current.expires > now:
                return False, current
            if mine:
                assert current is not None
                epoch = current.epoch
                run = last_run if last_run is not None else current.last_run
            else:
                epoch = current.epoch + 1 if current is not None else 1
                run = current.last_run if current is not None else None
            lease = Lease(node_id, instance, epoch, now + duration, run)
            self._write_lease(lease)
            return True, lease

    def release(self, instance: str, last_run: float | None) -> None:
        """Give the lease up (a clean stop), so another node takes it at its next try."""
        with self._locked():
            current = self.read_lease()
            if current is not None and current.instance == instance:
                run = last_run if last_run is not None else current.last_run
                self._write_lease(dataclasses.replace(current, expires=0.0, last_run=run))

    def publish(self, node_id: str, instance: str, data: bytes, sha256: str) -> Version | None:
        """Store ``data`` as the next version if it differs from the current one.

        Returns the new version, or None if ``data`` equals the current value.

        Raises:
            LeaseLostError: the lease is no longer this node's, or has expired.
        """
        with self._locked():
            lease = self.read_lease()
            if lease is None or lease.instance != instance or lease.expires <= time.time():
                raise LeaseLostError(lease.holder if lease is not None else None)
            current = _read_json(self.current_path)
            if current is not None and current.get("sha256") == sha256:
                return None
            version = int(current["version"]) + 1 if current is not None else 1
            _write_atomic(self.version_path(version), data, fsync=True)
            pointer = {
                "version": version,
                "bytes": len(data),
                "sha256": sha256,
                "node": node_id,
                "created": time.time(),
            }
            _write_atomic(self.current_path, json.dumps(pointer).encode(), fsync=True)
            with contextlib.suppress(FileNotFoundError):
                self.error_path.unlink()
            for old in self.root.glob("v*.bin"):
                number = old.stem[1:]
                if number.isdigit() and int(number) <= version - _KEEP_VERSIONS:
                    with contextlib.suppress(FileNotFoundError):
                        old.unlink()
        return Version(self.root.name, version, data, sha256)

    def load_newer(self, name: str, than: int) -> Version | None:
        """The version ``CURRENT`` names, if newer than ``than``; None if not newer.

        Raises:
            OSError, ValueError: the files could not be read or do not match (retry later).
        """
        pointer = _read_json(self.current_path)
        if pointer is None or int(pointer["version"]) <= than:
            return None
        version = int(pointer["version"])
        data = self.version_path(version).read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        if len(data) != int(pointer["bytes"]) or sha256 != pointer["sha256"]:
            raise ValueError(
                f"{self.version_path(version)} does not match {self.current_path} "
                f"({len(data)} bytes, sha256 {sha256[:12]}...)"
            )
        return Version(name, version, data, sha256)

    def record_error(self, node_id: str, message: str) -> None:
        body = {"node": node_id, "time": time.time(), "error": message}
        self.root.mkdir(parents=True, exist_ok=True)
        _write_atomic(self.error_path, json.dumps(body).encode(), fsync=False)

    def explain(self) -> str:
        """Why this side input has no value, as far as the shared files tell."""
        lease = self.read_lease()
        error = _read_json(self.error_path)
        if lease is None or lease.expires <= time.time():
            said = "no node holds its lease"
        else:
            said = f"node {lease.holder} holds its lease"
        if error is not None:
            ago = time.time() - float(error.get("time", 0))
            said += f"; node {error.get('node')} last failed {ago:.1f}s ago: {error.get('error')}"
        return said
