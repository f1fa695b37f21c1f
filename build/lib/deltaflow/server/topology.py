"""Cluster membership and the partition map, seen from one node.

Each node polls its peers' ``/v1/cluster`` endpoint every ``heartbeat_interval`` seconds. A peer
that answered within ``failure_timeout`` seconds is live. The partition map is computed from the
live set (self included) by rendezvous hashing, so every node with the same view computes the
same map; its version is the time (ms) the view last changed, so a newer view wins.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from ..partitioning import PartitionMap

__all__ = ["Member", "Membership"]

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Member:
    address: str
    node_id: str | None = None
    last_seen: float = 0.0  # monotonic seconds; 0 = never


class Membership:
    """Tracks which peers are live and derives the partition map.

    Args:
        node_id: this node's id.
        address: this node's ``host:port`` as peers and clients reach it.
        peers: other nodes' ``host:port``.
        partitions: the fixed partition count (must match on every node).
        heartbeat_interval: seconds between polls of each peer.
        failure_timeout: seconds without an answer after which a peer is considered dead.
        headers: sent with every poll (the cluster token).
    """

    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        peers: Sequence[str],
        partitions: int,
        heartbeat_interval: float = 0.5,
        failure_timeout: float = 3.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.partitions = partitions
        self.heartbeat_interval = heartbeat_interval
        self.failure_timeout = failure_timeout
        self._headers = headers or {}
        self._peers = {a: Member(a) for a in peers if a != address}
        self._map = PartitionMap.build(_now_ms(), {node_id: address}, partitions)
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def map(self) -> PartitionMap:
        return self._map

    def members(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        rows = [{"node": self.node_id, "address": self.address, "live": True, "self": True}]
        rows.extend(
            {
                "node": m.node_id,
                "address": m.address,
                "live": self._is_live(m, now),
                "self": False,
                "last_seen_ago": round(now - m.last_seen, 3) if m.last_seen else None,
            }
            for m in self._peers.values()
        )
        return rows

    async def wait_for_members(self, count: int) -> PartitionMap:
        """Wait until the map holds at least ``count`` live nodes (self included)."""
        while len(self._map.addresses) < count:
            await self._changed.wait()
        return self._map

    async def start(self) -> None:
        """Poll peers once (so a node starting beside live peers begins with the full map)."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=max(self.heartbeat_interval * 2, 1.0))
        )
        if self._peers:
            await self._poll_all()
        # Always poll: a peer that announces itself later (``observe``) is polled from then on.
        self._task = asyncio.create_task(self._loop(), name="deltaflow-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._session is not None:
            await self._session.close()

    def observe(self, node_id: str, address: str) -> None:
        """A peer contacted us: count it as seen (speeds up rejoin detection)."""
        if address == self.address:
            return
        member = self._peers.setdefault(address, Member(address))
        member.node_id = node_id
        member.last_seen = time.monotonic()
        self._recompute()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_interval)
            await self._poll_all()

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(m) for m in list(self._peers.values())))
        self._recompute()

    async def _poll(self, member: Member) -> None:
        assert self._session is not None
        try:
            async with self._session.get(
                f"http://{member.address}/v1/cluster",
                headers={**self._headers, "X-Deltaflow-Peer": f"{self.node_id}@{self.address}"},
            ) as resp:
                if resp.status != 200:
                    return
                body = await resp.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return
        if body.get("partitions") != self.partitions:
            log.error(
                "peer %s has %s partitions, this node %s: ignoring it (start every node with the "
                "same --partitions)",
                member.address,
                body.get("partitions"),
                self.partitions,
            )
            return
        member.node_id = str(body.get("node"))
        member.last_seen = time.monotonic()

    def _is_live(self, member: Member, now: float) -> bool:
        return bool(member.last_seen) and now - member.last_seen <= self.failure_timeout

    def _recompute(self) -> None:
        now = time.monotonic()
        live = {self.node_id: self.address}
        for m in self._peers.values():
            if m.node_id and self._is_live(m, now):
                live[m.node_id] = m.address
        if dict(self._map.addresses) == live:
            return
        self._map = PartitionMap.build(max(_now_ms(), self._map.version + 1), live, self.partitions)
        log.info("partition map v%d: members %s", self._map.version, sorted(live))
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
