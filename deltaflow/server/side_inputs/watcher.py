"""The watcher: every node picks up the versions other nodes published.

Every ``poll_interval`` seconds it reads each side input's ``CURRENT``. When that names a newer
version, it reads the version file, checks its size and SHA-256 against ``CURRENT``, and hands
it to the store, which swaps it in by replacing one reference.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence

from .directory import UNREADABLE
from .managed import Managed
from .version import Version

__all__ = ["watch"]

log = logging.getLogger(__package__)


async def watch(
    managed: Sequence[Managed], *, poll_interval: float, swap: Callable[[Managed, Version], None]
) -> None:
    """Every ``poll_interval`` seconds, ``swap`` in the newer versions of ``managed``, for ever."""
    while True:
        await asyncio.sleep(poll_interval)
        for m in managed:
            try:
                loaded = await asyncio.to_thread(
                    m.dir.load_newer, m.name, m.current.version if m.current else 0
                )
            except UNREADABLE as exc:
                # A version file pruned or replaced under the read: read again next time.
                log.debug("side input %s: version not readable yet: %s", m.name, exc)
                continue
            if loaded is not None:
                swap(m, loaded)
