"""The side inputs of one node: the lease, retrieval and watch tasks of each, and the values
receivers read."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Final

from ...errors import SideInputError
from ...receivers.side_input import SideInput
from ...storage.paths import Location
from ..statistics import SideInputStatistics
from .directory import UNREADABLE, Directory
from .lease import lease_loop
from .managed import Managed
from .retrieval import Retriever
from .version import Version
from .watcher import watch

__all__ = [
    "DEFAULT_SIDE_INPUT_LEASE",
    "DEFAULT_SIDE_INPUT_POLL_INTERVAL",
    "DEFAULT_SIDE_INPUT_TIMEOUT",
    "SideInputStore",
]

log = logging.getLogger(__package__)

#: Seconds a leader's lease lasts without renewal (renewed every third of it).
DEFAULT_SIDE_INPUT_LEASE: Final = 10.0
#: Seconds between two reads of a side input's ``CURRENT`` by every node.
DEFAULT_SIDE_INPUT_POLL_INTERVAL: Final = 0.5
#: Seconds a starting node waits for each side input to have a value.
DEFAULT_SIDE_INPUT_TIMEOUT: Final = 60.0


class SideInputStore:
    """The side inputs of one node: leases, retrievals, the watcher, and the reader receivers
    use (``get``, the :class:`deltaflow.receivers.base.SideInputReader` protocol).

    Args:
        warehouse: the shared warehouse, a directory or a prefix on an object store (the
            side inputs live under ``.deltaflow/side_inputs/``).
        node_id: this node's id (written into leases and versions).
        classes: the side-input classes (see :func:`load_side_inputs`).
        lease: seconds a leader's lease lasts; renewed every third of it. Default 10.
        poll_interval: seconds between two reads of each side input's ``CURRENT``. Default 0.5.

    Lifecycle: ``start()``, then ``wait_ready(timeout)``, then ``stop()`` (also after a failed
    ``wait_ready``). ``get`` may be called from any thread.
    """

    def __init__(
        self,
        warehouse: Location,
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
        root = warehouse / ".deltaflow" / "side_inputs"
        self._managed: dict[str, Managed] = {}
        for cls in classes:
            m = Managed(cls, Directory(root / cls.side_input_name()))
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

    def _swap(self, m: Managed, version: Version) -> None:
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
            except UNREADABLE as exc:
                log.warning("side input %s: cannot read the stored version yet: %s", m.name, exc)
                loaded = None
            if loaded is not None:
                self._swap(m, loaded)
        retriever = Retriever(node_id=self.node_id, instance=self._instance, swap=self._swap)
        for m in self._managed.values():
            leases = lease_loop(
                m, node_id=self.node_id, instance=self._instance, duration=self.lease
            )
            self._tasks.append(asyncio.create_task(leases, name=f"lease-{m.name}"))
            self._tasks.append(asyncio.create_task(retriever.loop(m), name=f"retrieve-{m.name}"))
        if self._managed:
            watcher = watch(
                list(self._managed.values()), poll_interval=self.poll_interval, swap=self._swap
            )
            self._tasks.append(asyncio.create_task(watcher, name="side-input-watch"))
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
                    except UNREADABLE as exc:
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
                except UNREADABLE as exc:
                    log.warning("side input %s: cannot release the lease: %s", m.name, exc)
