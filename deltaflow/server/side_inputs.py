"""Side inputs on a node: one leader retrieves, the warehouse stores, every node watches.

This is Numaflow's Side Inputs design with the shared warehouse directory as its data store
and its leader election (see ``docs/side-inputs.md``). Each side input has a directory::

    <warehouse>/.deltaflow/side_inputs/<name>/
        lock            flock target: every change of ``lease`` or ``CURRENT`` holds it
        lease           {"holder", "instance", "epoch", "expires", "last_run"}      (JSON)
        CURRENT         {"version", "bytes", "sha256", "node", "created"}          (JSON)
        v00000042.bin   the value of version 42; never rewritten once CURRENT names it
        error           the leader's latest failed retrieval; removed by the next success

Every file is written to a temporary name and moved into place with ``os.replace``, so a
reader sees a whole old file or a whole new one.

On every node, for each side input:

- the **lease loop** tries to take or renew the lease every ``lease / 3`` seconds, under the
  lock: a node takes it when it is free, expired or its own, and writes itself in as holder
  until ``now + lease``. When a leader dies, its lease runs out and another node takes it at
  its next try: within ``lease * 4 / 3`` of the leader's last renewal.
- the **retrieval loop** runs only while the node holds the lease: it calls the user's
  ``retrieve()`` when due and publishes a new version. Publishing checks, under the lock, that
  the lease is still this node's and unexpired (a fence: a leader that stalled past its lease
  and was replaced cannot overwrite the new leader's value).

On every node, one **watcher** reads each ``CURRENT`` every ``poll_interval`` seconds. When it
names a newer version, the watcher reads the version file, checks its size and SHA-256
against ``CURRENT``, and swaps it in by replacing one reference. A version is immutable:
readers (receivers, on the loop or in worker threads) get the old version or the new one,
never a mix, and each version parses once per parse function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import importlib
import inspect
import json
import logging
import os
import re
import threading
import time
import uuid
import zoneinfo
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from croniter import croniter

from ..errors import SideInputError, UsageError
from ..receivers.side_input import MAX_SIDE_INPUT_BYTES, SideInput
from ..tables.flock import file_lock

__all__ = [
    "DEFAULT_SIDE_INPUT_LEASE",
    "DEFAULT_SIDE_INPUT_POLL_INTERVAL",
    "DEFAULT_SIDE_INPUT_TIMEOUT",
    "SideInputStatistics",
    "SideInputStore",
    "load_side_inputs",
]

log = logging.getLogger(__name__)

#: Seconds a leader's lease lasts without renewal (renewed every third of it).
DEFAULT_SIDE_INPUT_LEASE: Final = 10.0
#: Seconds between two reads of a side input's ``CURRENT`` by every node.
DEFAULT_SIDE_INPUT_POLL_INTERVAL: Final = 0.5
#: Seconds a starting node waits for each side input to have a value.
DEFAULT_SIDE_INPUT_TIMEOUT: Final = 60.0

#: Versions kept on disk: a reader that read ``CURRENT`` just before newer versions landed
#: still finds its file, unless several versions landed within one of its reads.
_KEEP_VERSIONS: Final = 4
#: Parse results cached per version; more parse functions than this parse again.
_PARSE_CACHE: Final = 8
_BACKOFF_INITIAL: Final = 0.5
_BACKOFF_MAX: Final = 30.0
#: The lock is held for a few small file operations; waiting longer means a stuck process.
_LOCK_TIMEOUT: Final = 10.0
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")


# -- configuration ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Schedule:
    """When a side input is retrieved: every ``interval`` seconds, or on a cron expression."""

    interval: float | None
    cron: str | None
    tz: datetime.tzinfo

    @classmethod
    def of(cls, si: type[SideInput]) -> _Schedule:
        name = si.side_input_name()
        if (si.interval is None) == (si.cron is None):
            raise UsageError(
                f"side input {name!r} ({si.__qualname__}) must set exactly one of 'interval' "
                "(seconds) and 'cron' (a cron expression)"
            )
        try:
            tz = zoneinfo.ZoneInfo(si.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise UsageError(f"side input {name!r}: unknown timezone {si.timezone!r}") from exc
        if si.interval is not None:
            if isinstance(si.interval, bool) or not si.interval > 0:
                raise UsageError(f"side input {name!r}: interval must be > 0 seconds")
            return cls(float(si.interval), None, tz)
        assert si.cron is not None
        if not croniter.is_valid(si.cron):
            raise UsageError(f"side input {name!r}: {si.cron!r} is not a valid cron expression")
        return cls(None, si.cron, tz)

    def next_after(self, t: float) -> float:
        """The first scheduled run after the wall-clock time ``t``."""
        if self.interval is not None:
            return t + self.interval
        assert self.cron is not None
        start = datetime.datetime.fromtimestamp(t, self.tz)
        return float(croniter(self.cron, start).get_next(float))

    def __str__(self) -> str:
        return f"every {self.interval:g}s" if self.interval is not None else f"cron {self.cron!r}"


def load_side_inputs(names: Iterable[str | type[SideInput]]) -> list[type[SideInput]]:
    """Import side-input classes named ``"module.Class"`` (operator input, trusted) and check
    their name and schedule.

    Raises:
        UsageError: a name cannot be imported, is not a :class:`SideInput` subclass, has a bad
            schedule, or two classes share a side-input name.
    """
    classes: list[type[SideInput]] = []
    seen: dict[str, str] = {}
    for entry in names:
        if isinstance(entry, str):
            module_name, _, attr = entry.rpartition(".")
            if not module_name:
                raise UsageError(f"side input {entry!r} must be a dotted 'module.Class' name")
            try:
                cls = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise UsageError(f"cannot load side input {entry!r}: {exc}") from exc
        else:
            cls = entry
        if not (isinstance(cls, type) and issubclass(cls, SideInput)):
            raise UsageError(f"{entry!r} is not a subclass of deltaflow.receivers.SideInput")
        name = cls.side_input_name()
        if not _NAME.match(name):
            raise UsageError(
                f"side input name {name!r} ({cls.__qualname__}) is not allowed; use letters, "
                "digits, '_', '.' and '-' (at most 128), starting with a letter, digit or '_'"
            )
        if name in seen:
            raise UsageError(f"two side inputs are named {name!r}: {seen[name]} and {entry!r}")
        seen[name] = repr(entry)
        _Schedule.of(cls)
        if not cls.timeout > 0:
            raise UsageError(f"side input {name!r}: timeout must be > 0 seconds")
        classes.append(cls)
    return classes


# -- values -----------------------------------------------------------------------------------


class _Version:
    """One immutable version of a side input's value, with its parse results."""

    __slots__ = ("_lock", "_parsed", "data", "name", "sha256", "version")

    def __init__(self, name: str, version: int, data: bytes, sha256: str) -> None:
        self.name = name
        self.version = version
        self.data = data
        self.sha256 = sha256
        # Reentrant: a parse function may itself read a side input.
        self._lock = threading.RLock()
        self._parsed: OrderedDict[Callable[[bytes], Any], tuple[bool, Any]] = OrderedDict()

    def parsed(self, parse: Callable[[bytes], Any]) -> Any:
        """``parse(data)``, computed once per parse function (threads wait for the first)."""
        with self._lock:
            try:
                hit = self._parsed.get(parse)
            except TypeError:
                raise SideInputError(
                    f"parse function {parse!r} for side input {self.name!r} is not hashable"
                ) from None
            if hit is None:
                try:
                    hit = (True, parse(self.data))
                except Exception as exc:  # noqa: BLE001 - user code; reported to every caller
                    hit = (False, exc)
                self._parsed[parse] = hit
                while len(self._parsed) > _PARSE_CACHE:
                    self._parsed.popitem(last=False)
            else:
                self._parsed.move_to_end(parse)
        ok, value = hit
        if ok:
            return value
        raise SideInputError(
            f"parsing side input {self.name!r} version {self.version} "
            f"({len(self.data)} bytes) with {getattr(parse, '__qualname__', parse)!r} failed: "
            f"{type(value).__name__}: {value}"
        ) from value


@dataclass(frozen=True, slots=True, kw_only=True)
class SideInputStatistics:
    """A snapshot of one side input on one node.

    Attributes:
        name: the side input's name.
        version: the version this node serves; 0 before it has a value.
        leader: the node id holding the lease at this node's last look; None if none.
        is_leader: whether this node holds the lease (and so runs the retrievals).
        retrievals: ``retrieve()`` calls on this node.
        published: retrievals that made a new version.
        declined: retrievals that returned None (no new version).
        unchanged: retrievals that returned the current value's bytes (no new version).
        failures: retrievals that raised, timed out, or returned a bad value.
        last_error: the latest failure on this node, if any.
    """

    name: str
    version: int
    leader: str | None
    is_leader: bool
    retrievals: int
    published: int
    declined: int
    unchanged: int
    failures: int
    last_error: str | None


# -- the shared directory (blocking; always called in a worker thread) -----------------------


@dataclass(frozen=True, slots=True)
class _Lease:
    holder: str
    instance: str
    epoch: int
    expires: float
    last_run: float | None


class _LeaseLostError(Exception):
    """This node no longer holds the lease it retrieved under; the value is not published."""


class _RetrievalError(Exception):
    """A retrieval that timed out or returned a value deltaflow cannot store."""


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


class _Directory:
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

    def read_lease(self) -> _Lease | None:
        raw = _read_json(self.lease_path)
        if raw is None:
            return None
        last_run = raw.get("last_run")
        return _Lease(
            holder=str(raw["holder"]),
            instance=str(raw["instance"]),
            epoch=int(raw["epoch"]),
            expires=float(raw["expires"]),
            last_run=None if last_run is None else float(last_run),
        )

    def _write_lease(self, lease: _Lease) -> None:
        _write_atomic(self.lease_path, json.dumps(dataclasses.asdict(lease)).encode(), fsync=False)

    def try_lease(
        self, node_id: str, instance: str, duration: float, last_run: float | None
    ) -> tuple[bool, _Lease | None]:
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
            lease = _Lease(node_id, instance, epoch, now + duration, run)
            self._write_lease(lease)
            return True, lease

    def release(self, instance: str, last_run: float | None) -> None:
        """Give the lease up (a clean stop), so another node takes it at its next try."""
        with self._locked():
            current = self.read_lease()
            if current is not None and current.instance == instance:
                run = last_run if last_run is not None else current.last_run
                self._write_lease(dataclasses.replace(current, expires=0.0, last_run=run))

    def publish(self, node_id: str, instance: str, data: bytes, sha256: str) -> _Version | None:
        """Store ``data`` as the next version if it differs from the current one.

        Returns the new version, or None if ``data`` equals the current value.

        Raises:
            _LeaseLostError: the lease is no longer this node's, or has expired.
        """
        with self._locked():
            lease = self.read_lease()
            if lease is None or lease.instance != instance or lease.expires <= time.time():
                raise _LeaseLostError(lease.holder if lease is not None else None)
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
        return _Version(self.root.name, version, data, sha256)

    def load_newer(self, name: str, than: int) -> _Version | None:
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
        return _Version(name, version, data, sha256)

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


# -- the store --------------------------------------------------------------------------------


class _Managed:
    """One side input on this node: its class, schedule, files, current value and counters."""

    def __init__(self, cls: type[SideInput], directory: _Directory) -> None:
        self.cls = cls
        self.name = cls.side_input_name()
        self.schedule = _Schedule.of(cls)
        self.dir = directory
        try:
            self.instance = cls()
        except Exception as exc:
            raise UsageError(
                f"side input {self.name!r}: {cls.__qualname__}() raised {exc!r}"
            ) from exc
        self.current: _Version | None = None
        self.ready = asyncio.Event()
        self.wake = asyncio.Event()
        self.is_leader = False
        self.epoch = 0  # the lease epoch this node leads under (a new epoch: a new leadership)
        self.leader: str | None = None
        self.last_run: float | None = None
        # Its own thread for a synchronous retrieve(): one call at a time, even after a call
        # timed out (its thread cannot be stopped), and never starving the node's other work.
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=f"deltaflow-side-{self.name}")
        self.running: concurrent.futures.Future[Any] | None = None
        # The SHA-256 CURRENT holds, as this node last wrote or checked it under its lease.
        self.stored_sha256: str | None = None
        self.next_run = 0.0
        self.backoff = _BACKOFF_INITIAL
        self.retrievals = 0
        self.published = 0
        self.declined = 0
        self.unchanged = 0
        self.failures = 0
        self.last_error: str | None = None


class SideInputStore:
    """The side inputs of one node: leases, retrievals, the watcher, and the reader receivers
    use (``get``, the :class:`deltaflow.receivers.base.SideInputReader` protocol).

    Args:
        warehouse: the shared warehouse directory (the side inputs live under
            ``.deltaflow/side_inputs/``).
        node_id: this node's id (written into leases and versions).
        classes: the side-input classes (see :func:`load_side_inputs`).
        lease: seconds a leader's lease lasts; renewed every third of it. Default 10.
        poll_interval: seconds between two reads of each side input's ``CURRENT``. Default 0.5.

    Lifecycle: ``start()``, then ``wait_ready(timeout)``, then ``stop()`` (also after a failed
    ``wait_ready``). ``get`` may be called from any thread.
    """

    def __init__(
        self,
        warehouse: Path,
        *,
        node_id: str,
        classes: Iterable[type[SideInput]],
        lease: float = DEFAULT_SIDE_INPUT_LEASE,
        poll_interval: float = DEFAULT_SIDE_INPUT_POLL_INTERVAL,
    ) -> None:
        self.node_id = node_id
        self.lease = lease
        self.poll_interval = poll_interval
        # Unique per process lifetime: a node restarted under the same id does not mistake
        # its previous incarnation's lease for its own.
        self._instance = f"{node_id}/{uuid.uuid4().hex}"
        root = Path(warehouse) / ".deltaflow" / "side_inputs"
        self._managed: dict[str, _Managed] = {}
        for cls in classes:
            m = _Managed(cls, _Directory(root / cls.side_input_name()))
            self._managed[m.name] = m
        self._lock = threading.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    def __repr__(self) -> str:
        parts = ", ".join(
            f"{m.name}=v{m.current.version if m.current else 0}{'*' if m.is_leader else ''}"
            for m in self._managed.values()
        )
        return f"<SideInputStore {self.node_id} {parts}>"

    def names(self) -> list[str]:
        return sorted(self._managed)

    # -- reading (any thread) -------------------------------------------------------------

    def get(self, name: str, parse: Callable[[bytes], Any] | None = None) -> Any:
        """The current value of side input ``name``: the bytes, or ``parse(bytes)`` computed
        once per version and parse function.

        Raises:
            SideInputError: no side input of that name, no value yet, or ``parse`` raised.
        """
        m = self._managed.get(name)
        if m is None:
            raise SideInputError(
                f"side input {name!r} is not configured on node {self.node_id} (configured: "
                f"{', '.join(self.names()) or 'none'}); start every node with "
                "--side-input module.Class",
                node=self.node_id,
            )
        with self._lock:
            current = m.current
        if current is None:
            raise SideInputError(f"side input {name!r} has no value yet", node=self.node_id)
        return current.data if parse is None else current.parsed(parse)

    def version(self, name: str) -> int:
        """The version of side input ``name`` this node serves (0: none yet)."""
        current = self._managed[name].current
        return current.version if current is not None else 0

    def statistics(self) -> tuple[SideInputStatistics, ...]:
        return tuple(
            SideInputStatistics(
                name=m.name,
                version=m.current.version if m.current is not None else 0,
                leader=m.leader,
                is_leader=m.is_leader,
                retrievals=m.retrievals,
                published=m.published,
                declined=m.declined,
                unchanged=m.unchanged,
                failures=m.failures,
                last_error=m.last_error,
            )
            for m in self._managed.values()
        )

    def _swap(self, m: _Managed, version: _Version) -> None:
        """Serve ``version`` from now on, if it is newer (never go back to an older one)."""
        with self._lock:
            if m.current is not None and m.current.version >= version.version:
                return
            previous = m.current
            m.current = version
        m.ready.set()
        log.info(
            "side input %s: serving version %d (%d bytes)%s",
            m.name,
            version.version,
            len(version.data),
            f", was {previous.version}" if previous is not None else "",
        )

    # -- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the stored versions, then start the lease, retrieval and watch tasks.

        Raises:
            OSError: the warehouse cannot be read.
        """
        for m in self._managed.values():
            try:
                loaded = await asyncio.to_thread(m.dir.load_newer, m.name, 0)
            except (OSError, ValueError, KeyError, TypeError) as exc:
                log.warning("side input %s: cannot read the stored version yet: %s", m.name, exc)
                loaded = None
            if loaded is not None:
                self._swap(m, loaded)
        for m in self._managed.values():
            self._tasks.append(asyncio.create_task(self._lease_loop(m), name=f"lease-{m.name}"))
            self._tasks.append(
                asyncio.create_task(self._retrieval_loop(m), name=f"retrieve-{m.name}")
            )
        if self._managed:
            self._tasks.append(asyncio.create_task(self._watch(), name="side-input-watch"))
        for task in self._tasks:
            task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        # The loops catch every expected error; one that still ends is a bug worth shouting.
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "side-input task %s on node %s died; this node no longer updates it",
                task.get_name(),
                self.node_id,
                exc_info=task.exception(),
            )

    async def wait_ready(self, timeout: float) -> None:
        """Wait until every side input has a value on this node.

        Raises:
            SideInputError: some have none after ``timeout`` seconds; the message names each
                and says why, as far as this node can tell.
        """
        try:
            async with asyncio.timeout(timeout):
                for m in self._managed.values():
                    await m.ready.wait()
        except TimeoutError:
            missing = [m for m in self._managed.values() if m.current is None]
            reasons = []
            for m in missing:
                if m.is_leader:
                    why = f"this node retrieves it ({m.failures} failed retrievals"
                    why += f", last: {m.last_error})" if m.last_error else ")"
                else:
                    try:
                        why = await asyncio.to_thread(m.dir.explain)
                    except (OSError, ValueError, KeyError, TypeError) as exc:
                        why = f"its files cannot be read: {exc}"
                reasons.append(
                    f"side input {m.name!r} ({m.cls.__module__}.{m.cls.__qualname__}, "
                    f"{m.schedule}): {why}"
                )
            raise SideInputError(
                f"node {self.node_id} does not start: no value after {timeout:g}s for "
                + "; ".join(reasons)
                + ". Fix the side input's source, or raise side_input_timeout "
                "(--side-input-timeout)",
                node=self.node_id,
            ) from None

    async def stop(self) -> None:
        """Stop the tasks and give up the leases this node holds (others take over at once).

        A synchronous ``retrieve()`` still running in its thread is left to finish; its value
        is not published.
        """
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for m in self._managed.values():
            m.executor.shutdown(wait=False, cancel_futures=True)
            if m.is_leader:
                m.is_leader = False
                try:
                    await asyncio.to_thread(m.dir.release, self._instance, m.last_run)
                except OSError as exc:
                    log.warning("side input %s: cannot release the lease: %s", m.name, exc)

    # -- tasks ----------------------------------------------------------------------------

    async def _lease_loop(self, m: _Managed) -> None:
        """Take or renew the lease every ``lease / 3`` seconds."""
        while True:
            try:
                held, lease = await asyncio.to_thread(
                    m.dir.try_lease, self.node_id, self._instance, self.lease, m.last_run
                )
            except (OSError, ValueError, KeyError, TypeError) as exc:
                # Unreadable lease or lock trouble: act as a follower until it clears up.
                log.warning("side input %s: lease check failed: %s", m.name, exc)
                held, lease = False, None
            m.leader = lease.holder if lease is not None and lease.expires > time.time() else None
            if held and lease is not None and (not m.is_leader or lease.epoch != m.epoch):
                # Also when this node re-took the lease under a new epoch without noticing
                # it lost it: another leader may have published meanwhile.
                m.is_leader = True
                m.epoch = lease.epoch
                m.stored_sha256 = None
                m.last_run = lease.last_run
                overdue = m.current is None or m.last_run is None
                m.next_run = time.time() if overdue else m.schedule.next_after(m.last_run or 0)
                m.backoff = _BACKOFF_INITIAL
                log.info(
                    "side input %s: node %s is the leader (epoch %d), next retrieval in %.1fs",
                    m.name,
                    self.node_id,
                    lease.epoch,
                    max(0.0, m.next_run - time.time()),
                )
                m.wake.set()
            elif not held and m.is_leader:
                m.is_leader = False
                log.warning(
                    "side input %s: node %s lost the lease to %s",
                    m.name,
                    self.node_id,
                    m.leader or "nobody",
                )
                m.wake.set()
            await asyncio.sleep(self.lease / 3)

    async def _retrieval_loop(self, m: _Managed) -> None:
        """While this node leads, retrieve when due; otherwise wait to become the leader."""
        while True:
            delay = m.next_run - time.time() if m.is_leader else None
            if delay is None or delay > 0:
                # Wakes on a leadership change, or when the next run is due.
                m.wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(delay):
                        await m.wake.wait()
                continue
            await self._retrieve(m)

    async def _call(self, m: _Managed) -> object:
        retrieve = m.instance.retrieve
        if inspect.iscoroutinefunction(retrieve):
            result: object = await retrieve()
        else:
            if m.running is not None and not m.running.done():
                raise _RetrievalError(
                    "the previous retrieve() is still running after its timeout; this run is "
                    "skipped (one call at a time)"
                )
            m.running = m.executor.submit(retrieve)
            result = await asyncio.wrap_future(m.running)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _retrieve(self, m: _Managed) -> None:
        started = time.time()
        m.retrievals += 1
        try:
            try:
                async with asyncio.timeout(m.cls.timeout):
                    value = await self._call(m)
            except TimeoutError:
                raise _RetrievalError(f"retrieve() took more than {m.cls.timeout:g}s") from None
            data = _check_value(m.name, value)
            version = None
            if data is None:
                m.declined += 1
            elif (sha256 := hashlib.sha256(data).hexdigest()) == m.stored_sha256:
                m.unchanged += 1  # what CURRENT holds since this node took the lease
            else:
                version = await asyncio.to_thread(
                    m.dir.publish, self.node_id, self._instance, data, sha256
                )
                m.stored_sha256 = sha256
                if version is None:
                    m.unchanged += 1
        except _LeaseLostError as exc:
            log.warning(
                "side input %s: lease lost to %s during retrieval; value not published",
                m.name,
                exc.args[0] or "nobody",
            )
            m.is_leader = False
            return
        except Exception as exc:  # noqa: BLE001 - user code: any error is a failed retrieval
            m.failures += 1
            m.last_error = (
                str(exc) if isinstance(exc, _RetrievalError) else f"{type(exc).__name__}: {exc}"
            )
            # Back off, but never past the next scheduled run.
            retry_at = min(time.time() + m.backoff, m.schedule.next_after(started))
            m.next_run = retry_at
            m.backoff = min(m.backoff * 2, _BACKOFF_MAX)
            log.warning(
                "side input %s: retrieval %d failed, retrying in %.1fs: %s",
                m.name,
                m.retrievals,
                max(0.0, retry_at - time.time()),
                m.last_error,
            )
            with contextlib.suppress(OSError):
                await asyncio.to_thread(m.dir.record_error, self.node_id, m.last_error)
            return
        m.backoff = _BACKOFF_INITIAL
        m.last_run = started
        m.next_run = m.schedule.next_after(started)
        if version is not None:
            m.published += 1
            self._swap(m, version)

    async def _watch(self) -> None:
        """Every ``poll_interval`` seconds, pick up newer versions other nodes published."""
        while True:
            await asyncio.sleep(self.poll_interval)
            for m in self._managed.values():
                try:
                    loaded = await asyncio.to_thread(
                        m.dir.load_newer, m.name, m.current.version if m.current else 0
                    )
                except (OSError, ValueError, KeyError, TypeError) as exc:
                    # A version file pruned or replaced under the read: read again next time.
                    log.debug("side input %s: version not readable yet: %s", m.name, exc)
                    continue
                if loaded is not None:
                    self._swap(m, loaded)


def _check_value(name: str, value: object) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise _RetrievalError(
            f"retrieve() of side input {name!r} returned {type(value).__name__}; return bytes "
            "(encode text or JSON yourself) or None to keep the current value"
        )
    if len(value) > MAX_SIDE_INPUT_BYTES:
        raise _RetrievalError(
            f"retrieve() of side input {name!r} returned {len(value):,} bytes, more than the "
            f"limit of {MAX_SIDE_INPUT_BYTES:,}; keep side inputs small (configuration, lookup "
            "tables) and put larger data in a table"
        )
    return value
