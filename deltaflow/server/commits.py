"""Which node commits a table, and getting each prepared group to it.

Every table has one committer among the live nodes: the node that rendezvous hashing of the
table's name over the cluster map ranks first (:meth:`.PartitionMap.committer`), so every
node with the same map agrees without asking anyone, and a table's committer changes only
when that node joins or leaves. A writer sends each group it prepared
(:class:`.PreparedCommit`) to the committer (``POST /v1/peer/commit``, proven like every peer
call) and waits for its outcome; the committer of a table this node commits is its own
:class:`.TableCommitter`.

When the committer dies, the map changes within the failure timeout and the writer resends
the group to the next one; when the committer cannot be reached for longer than that while
the map still names it (a one-way partition), the writer commits the group itself. Neither can
apply a group twice: a commit lands only at the version after the one its lane marks were
checked at, and the next committer finds a group that did land by its marks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Final

import aiohttp

from ..errors import UsageError
from ..partitioning import PartitionMap
from ..receivers.base import check_table_name
from ..tables.commit.ownership import Ownership
from ..tables.commit.prepared import Outcome, PreparedCommit, WireError
from .peers import PeerClient

if TYPE_CHECKING:
    from ..tables.engine import TableEngine

__all__ = ["MAX_COMMIT_CALL_BYTES", "CommitRouter", "read_prepared"]

log = logging.getLogger(__name__)

#: The largest prepared group a committer reads (actions only: a few hundred bytes a file).
MAX_COMMIT_CALL_BYTES: Final = 8 * 1024 * 1024
#: How often a writer waiting on a committer looks whether the map named another one.
WATCH_SECONDS: Final = 0.1
#: Seconds a map this node replaced still counts for groups of other nodes (at least): one
#: prepared just before its writer's partition moved is still its own.
OWNERSHIP_GRACE: Final = 10.0
#: Longest wait for one commit call (a committer that is alive but slow; a dead one is
#: noticed by the map long before).
CALL_SECONDS: Final = 600.0


def read_prepared(data: bytes) -> PreparedCommit | str:
    """The prepared group in a commit call's body, or why it is not one. Blocking (a body of
    8 MiB takes a while to parse: a worker thread's job). Returns the reason rather than
    raising it, so no traceback keeps the parsed body alive after the answer."""
    try:
        prepared = PreparedCommit.from_wire(json.loads(data))
        check_table_name(prepared.table)
    except (ValueError, RecursionError, UsageError) as exc:
        return str(exc)
    return prepared


class CommitRouter:
    """Gets a writer's prepared groups committed (the engine's commit sink).

    Args:
        node_id: this node.
        engine: its table engine, whose committers commit the tables this node commits.
        peers: the client for commit calls to other nodes.
        partition_map: the node's current map.
        failure_timeout: how long a committer the map still names may stay unreachable
            before this node commits the group itself.
    """

    def __init__(
        self,
        *,
        node_id: str,
        engine: TableEngine,
        peers: PeerClient,
        partition_map: Callable[[], PartitionMap],
        failure_timeout: float,
        on_failed_call: Callable[[str], None] | None = None,
    ) -> None:
        self.node_id = node_id
        #: Told the address of a committer whose call failed (the membership polls it).
        self._on_failed_call = on_failed_call
        self._engine = engine
        self._peers = peers
        self._map = partition_map
        self._failure_timeout = failure_timeout
        # Groups of other nodes are checked against this node's maps (its committers).
        self.ownership = Ownership(
            partition_map,
            grace=max(OWNERSHIP_GRACE, 4 * failure_timeout),
            wait=failure_timeout,
        )
        # Committers whose commit calls went unanswered, since when, and when one was last
        # tried: once past the failure timeout, groups are committed here at once, and the
        # committer is tried again once per failure timeout (the cut may heal).
        self._unreachable: dict[str, tuple[float, float]] = {}

    def committer(self, table: str) -> tuple[str, str]:
        """The node that commits ``table`` by the current map, and its address."""
        pmap = self._map()
        node_id = pmap.committer(table)
        return node_id, pmap.addresses[node_id]

    async def submit(self, prepared: PreparedCommit) -> Outcome:
        """The outcome of ``prepared`` from its table's committer (whichever node that is by
        the time it answers)."""
        tried = False  # this group tried the committer once
        while True:
            node_id, address = self.committer(prepared.table)
            if node_id == self.node_id:
                return await self._engine.committer(prepared.table).submit(prepared, self.ownership)
            now = time.monotonic()
            since, last_try = self._unreachable.get(node_id, (now, now))
            if now - since > self._failure_timeout and (
                tried or now - last_try < self._failure_timeout
            ):
                log.warning(
                    "table %s: committer %s unreachable for %.1f s; committing here",
                    prepared.table,
                    node_id,
                    now - since,
                )
                return await self._engine.committer(prepared.table).submit(prepared, self.ownership)
            tried = True
            call = asyncio.ensure_future(self._call(address, prepared))
            moved = False
            try:
                while not call.done():
                    await asyncio.wait({call}, timeout=WATCH_SECONDS)
                    if not call.done() and self.committer(prepared.table) != (node_id, address):
                        moved = True  # the map named another committer: resend it there
                        break
            finally:
                if not call.done():
                    call.cancel()
                    with contextlib.suppress(BaseException):
                        await call
            if moved:
                log.info(
                    "table %s: committer %s replaced; resending a group", prepared.table, node_id
                )
                continue
            try:
                outcome = call.result()
            except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as exc:
                if self._on_failed_call is not None and isinstance(
                    exc, OSError | aiohttp.ClientConnectionError
                ):
                    self._on_failed_call(address)
                now = time.monotonic()
                self._unreachable[node_id] = (self._unreachable.get(node_id, (now, now))[0], now)
                log.info("table %s: committer %s did not answer (%s)", prepared.table, node_id, exc)
                await asyncio.sleep(WATCH_SECONDS)
                continue
            self._unreachable.pop(node_id, None)
            return outcome

    async def _call(self, address: str, prepared: PreparedCommit) -> Outcome:
        body = json.dumps(prepared.to_wire(), separators=(",", ":")).encode()
        reply = await self._peers.call(address, "commit", body=body, timeout=CALL_SECONDS)
        if reply.status != 200 or not reply.proven:
            error = reply.body.get("error") if isinstance(reply.body, dict) else None
            raise ValueError(f"committer at {address} answered {reply.status}: {error}")
        try:
            return Outcome.from_wire(reply.body.get("outcome"))
        except WireError as exc:
            raise ValueError(f"committer at {address}: {exc}") from exc
