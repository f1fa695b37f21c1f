"""The lease loop: whether this node leads a side input, and so retrieves it (the rules are in
the package's docstring)."""

from __future__ import annotations

import asyncio
import logging
import time

from .directory import UNREADABLE
from .managed import Managed

__all__ = ["lease_loop"]

log = logging.getLogger(__package__)


async def lease_loop(m: Managed, *, node_id: str, instance: str, duration: float) -> None:
    """Take or renew the lease of ``m`` every ``duration / 3`` seconds, for ever.

    Args:
        node_id: this node's id (the lease's holder).
        instance: this node's process (a node restarted under the same id is another).
        duration: seconds a lease lasts without renewal.
    """
    while True:
        try:
            held, lease = await asyncio.to_thread(
                m.dir.try_lease, node_id, instance, duration, m.last_run
            )
        except UNREADABLE as exc:
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
            log.info(
                "side input %s: node %s is the leader (epoch %d), next retrieval in %.1fs",
                m.name,
                node_id,
                lease.epoch,
                max(0.0, m.next_run - time.time()),
            )
            m.leadership_changed()
        elif not held and m.is_leader:
            m.is_leader = False
            log.warning(
                "side input %s: node %s lost the lease to %s",
                m.name,
                node_id,
                m.leader or "nobody",
            )
            m.leadership_changed()
        await asyncio.sleep(duration / 3)
