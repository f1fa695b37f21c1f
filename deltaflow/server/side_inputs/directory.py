"""One side input's place in the warehouse (a directory, or a prefix on an object store): its
lease and ``CURRENT`` pointer in one ``state`` record, its versions, its last error. Every call
blocks (the node runs them in worker threads).

``state`` is replaced only by compare-and-swap (:mod:`deltaflow.storage.records`: an ETag
``If-Match`` put on a store, a compare under an ``flock`` on disk), so taking the lease,
renewing it and publishing a version are each one atomic step that fails when any other node
changed ``state`` since it was read. That makes the publish fence exact without any lock the
hosts share: a leader's publish lands only if no other node took the lease since the leader
read it, valid, as its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from obstore.exceptions import BaseError as StoreError

from ..._faults import fault_point
from ...storage.paths import Location
from ...storage.records import Tagged, read_tagged, replace_if_unchanged, write_whole
from .version import Version

__all__ = ["UNREADABLE", "Directory", "Lease", "LeaseLostError"]

#: What reading or writing a side input's records may raise when the disk or the store is in
#: trouble, or a record is damaged: the loops log these and try again later.
UNREADABLE: Final = (OSError, ValueError, KeyError, TypeError, StoreError)

#: Versions kept: a reader that read ``state`` just before newer versions landed still finds
#: its file, unless several versions landed within one of its reads.
_KEEP_VERSIONS: Final = 4
#: Times a change of ``state`` is decided again after another node changed it first. Nodes
#: change it every few seconds, so losing this many races in a row means something is wrong.
_SWAP_ATTEMPTS: Final = 8

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Lease:
    holder: str
    instance: str
    epoch: int
    expires: float
    last_run: float | None


class LeaseLostError(Exception):
    """This node no longer holds the lease it retrieved under; the value is not published."""


@dataclass(frozen=True, slots=True)
class _State:
    lease: Lease | None
    current: dict[str, Any] | None  # version, bytes, sha256, file, node, created
    read: Tagged | None  # what was read, for the swap

    @classmethod
    def parse(cls, read: Tagged | None) -> _State:
        if read is None:
            return cls(None, None, None)
        raw = json.loads(read.data)
        lease = raw.get("lease")
        return cls(_lease(lease) if lease else None, raw.get("current"), read)

    def encode(self, *, lease: Lease | None, current: dict[str, Any] | None) -> bytes:
        return json.dumps(
            {"lease": dataclasses.asdict(lease) if lease else None, "current": current}
        ).encode()


def _lease(raw: dict[str, Any]) -> Lease:
    last_run = raw.get("last_run")
    return Lease(
        holder=str(raw["holder"]),
        instance=str(raw["instance"]),
        epoch=int(raw["epoch"]),
        expires=float(raw["expires"]),
        last_run=None if last_run is None else float(last_run),
    )


class Directory:
    """One side input's place in the warehouse. Every method blocks."""

    def __init__(self, root: Location) -> None:
        self.root = root
        self.state_path = root / "state"
        self.error_path = root / "error"

    def _read(self) -> _State:
        return _State.parse(read_tagged(self.state_path))

    def _swap(self, change: Callable[[_State], tuple[bytes | None, T]]) -> T:
        """Apply ``change`` (state -> (new content or None for no change, result)) atomically,
        deciding again whenever another node changed ``state`` first.

        Raises:
            OSError: it lost the race ``_SWAP_ATTEMPTS`` times in a row.
        """
        for _ in range(_SWAP_ATTEMPTS):
            state = self._read()
            data, result = change(state)
            if data is None or replace_if_unchanged(self.state_path, data, state.read):
                return result
        raise OSError(f"{self.state_path} kept changing under {_SWAP_ATTEMPTS} attempts")

    def read_lease(self) -> Lease | None:
        return self._read().lease

    def try_lease(
        self, node_id: str, instance: str, duration: float, last_run: float | None
    ) -> tuple[bool, Lease | None]:
        """Take or renew the lease if it is free, expired or ours; (held, the lease now).

        Raises:
            OSError: the record could not be read or written, or kept changing.
        """

        def change(state: _State) -> tuple[bytes | None, tuple[bool, Lease | None]]:
            now = time.time()
            current = state.lease
            mine = current is not None and current.instance == instance
            if current is not None and not mine and current.expires > now:
                return None, (False, current)
            if mine:
                assert current is not None
                epoch = current.epoch
                run = last_run if last_run is not None else current.last_run
            else:
                epoch = current.epoch + 1 if current is not None else 1
                run = current.last_run if current is not None else None
            lease = Lease(node_id, instance, epoch, now + duration, run)
            return state.encode(lease=lease, current=state.current), (True, lease)

        return self._swap(change)

    def release(self, instance: str, last_run: float | None) -> None:
        """Give the lease up (a clean stop), so another node takes it at its next try."""

        def change(state: _State) -> tuple[bytes | None, None]:
            lease = state.lease
            if lease is None or lease.instance != instance:
                return None, None
            run = last_run if last_run is not None else lease.last_run
            freed = dataclasses.replace(lease, expires=0.0, last_run=run)
            return state.encode(lease=freed, current=state.current), None

        self._swap(change)

    def version_path(self, version: int, sha256: str) -> Location:
        # Named by content too: a leader fenced off after writing its file cannot have
        # overwritten the file of the same number another leader published.
        return self.root / f"v{version:08d}-{sha256[:16]}.bin"

    def publish(self, node_id: str, instance: str, data: bytes, sha256: str) -> Version | None:
        """Store ``data`` as the next version if it differs from the current one.

        Returns the new version, or None if ``data`` equals the current value.

        Raises:
            LeaseLostError: the lease is no longer this node's, or has expired.
            OSError: the record could not be read or written, or kept changing.
        """
        written: set[str] = set()

        def change(state: _State) -> tuple[bytes | None, int | None]:
            lease = state.lease
            if lease is None or lease.instance != instance or lease.expires <= time.time():
                raise LeaseLostError(lease.holder if lease is not None else None)
            current = state.current
            if current is not None and current.get("sha256") == sha256:
                return None, None
            version = int(current["version"]) + 1 if current is not None else 1
            file = self.version_path(version, sha256)
            if file.name not in written:
                write_whole(file, data)
                written.add(file.name)
            fault_point("side_input_publish")
            pointer = {
                "version": version,
                "bytes": len(data),
                "sha256": sha256,
                "file": file.name,
                "node": node_id,
                "created": time.time(),
            }
            return state.encode(lease=lease, current=pointer), version

        version = self._swap(change)
        if version is None:
            return None
        with contextlib.suppress(FileNotFoundError):
            self.error_path.unlink()
        self._prune(version)
        return Version(self.root.name, version, data, sha256)

    def _prune(self, version: int) -> None:
        for old in self.root.glob("v*.bin"):
            number = old.name[1:9]
            if number.isdigit() and int(number) <= version - _KEEP_VERSIONS:
                with contextlib.suppress(FileNotFoundError):
                    old.unlink()

    def load_newer(self, name: str, than: int) -> Version | None:
        """The version ``state`` names, if newer than ``than``; None if not newer.

        Raises:
            OSError, ValueError: the files could not be read or do not match (retry later).
        """
        pointer = self._read().current
        if pointer is None or int(pointer["version"]) <= than:
            return None
        version = int(pointer["version"])
        file = self.root / str(pointer["file"])
        data = file.read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        if len(data) != int(pointer["bytes"]) or sha256 != pointer["sha256"]:
            raise ValueError(
                f"{file} does not match {self.state_path} ({len(data)} bytes, sha256 "
                f"{sha256[:12]}...)"
            )
        return Version(name, version, data, sha256)

    def record_error(self, node_id: str, message: str) -> None:
        body = {"node": node_id, "time": time.time(), "error": message}
        write_whole(self.error_path, json.dumps(body).encode())

    def explain(self) -> str:
        """Why this side input has no value, as far as the shared records tell."""
        lease = self.read_lease()
        try:
            error = json.loads(self.error_path.read_bytes())
        except FileNotFoundError:
            error = None
        if lease is None or lease.expires <= time.time():
            said = "no node holds its lease"
        else:
            said = f"node {lease.holder} holds its lease"
        if isinstance(error, dict):
            ago = time.time() - float(error.get("time", 0))
            said += f"; node {error.get('node')} last failed {ago:.1f}s ago: {error.get('error')}"
        return said
