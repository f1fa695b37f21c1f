"""The retrievals a side input's leader runs: ``retrieve()`` when due, its value published as
the next version. A failed retrieval is retried with backoff (tenacity), never past the next
scheduled run, for as long as this node's leadership lasts.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import logging
import time
from collections.abc import Callable
from typing import Final

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_exponential

from ...receivers.side_input import MAX_SIDE_INPUT_BYTES
from .directory import UNREADABLE, LeaseLostError
from .managed import Managed
from .version import Version

__all__ = ["RetrievalError", "Retriever"]

log = logging.getLogger(__package__)

#: Waits between the retries of a failed retrieval: 0.5 s, doubling up to 30 s.
_BACKOFF: Final = wait_exponential(multiplier=0.5, max=30.0)


class RetrievalError(Exception):
    """A retrieval that timed out or returned a value deltaflow cannot store."""


class _LeadershipChangedError(Exception):
    """Ends the retries of a retrieval: the leadership they ran under changed."""


class Retriever:
    """Runs the retrievals of the side inputs this node leads.

    Args:
        node_id: this node's id (written into the versions it publishes).
        instance: this node's process, as its leases name it.
        swap: serves a version this node published.
    """

    def __init__(
        self, *, node_id: str, instance: str, swap: Callable[[Managed, Version], None]
    ) -> None:
        self.node_id = node_id
        self.instance = instance
        self._swap = swap

    async def loop(self, m: Managed) -> None:
        """While this node leads ``m``, retrieve when due; otherwise wait to become the leader."""
        while True:
            delay = m.next_run - time.time() if m.is_leader else None
            if delay is None or delay > 0:
                # Wakes on a leadership change, or when the next run is due.
                await m.woken(delay)
                continue
            with contextlib.suppress(_LeadershipChangedError):
                await self._retrieve_retrying(m)

    async def _retrieve_retrying(self, m: Managed) -> None:
        """One scheduled retrieval, retried until it succeeds.

        Raises:
            _LeadershipChangedError: this node's leadership changed while it waited to retry.
        """
        term = m.term
        started = time.time()  # of the latest attempt

        def wait(state: RetryCallState) -> float:
            # Back off, but never past the next scheduled run.
            due = m.schedule.next_after(started) - time.time()
            return max(0.0, min(_BACKOFF(state), due))

        async def sleep(seconds: float) -> None:
            if m.term == term:
                await m.woken(seconds)
            if m.term != term:
                raise _LeadershipChangedError

        def log_retry(state: RetryCallState) -> None:
            log.warning(
                "side input %s: retrieval %d failed, retrying in %.1fs: %s",
                m.name,
                m.retrievals,
                state.upcoming_sleep,
                m.last_error,
            )

        retrying = AsyncRetrying(
            retry=retry_if_exception_type(Exception),
            wait=wait,
            sleep=sleep,
            before_sleep=log_retry,
        )
        async for attempt in retrying:
            with attempt:
                started = time.time()
                await self._retrieve(m, started)

    async def _call(self, m: Managed) -> object:
        retrieve = m.instance.retrieve
        if inspect.iscoroutinefunction(retrieve):
            result: object = await retrieve()
        else:
            if m.running is not None and not m.running.done():
                raise RetrievalError(
                    "the previous retrieve() is still running after its timeout; this run is "
                    "skipped (one call at a time)"
                )
            m.running = m.executor.submit(retrieve)
            result = await asyncio.wrap_future(m.running)
        if inspect.isawaitable(result):
            result = await result
        return result

    async def _retrieve(self, m: Managed, started: float) -> None:
        """One retrieval; a new value is published, and served here at once.

        Raises:
            Exception: the retrieval failed (counted, and recorded in the directory, first).
        """
        m.retrievals += 1
        try:
            try:
                async with asyncio.timeout(m.cls.timeout):
                    value = await self._call(m)
            except TimeoutError:
                raise RetrievalError(f"retrieve() took more than {m.cls.timeout:g}s") from None
            data = check_value(m.name, value)
            version = None
            if data is None:
                m.declined += 1
            elif (sha256 := hashlib.sha256(data).hexdigest()) == m.stored_sha256:
                m.unchanged += 1  # what CURRENT holds since this node took the lease
            else:
                version = await asyncio.to_thread(
                    m.dir.publish, self.node_id, self.instance, data, sha256
                )
                m.stored_sha256 = sha256
                if version is None:
                    m.unchanged += 1
        except LeaseLostError as exc:
            log.warning(
                "side input %s: lease lost to %s during retrieval; value not published",
                m.name,
                exc.args[0] or "nobody",
            )
            m.is_leader = False
            return
        except Exception as exc:  # user code: any error is a failed retrieval
            m.failures += 1
            m.last_error = (
                str(exc) if isinstance(exc, RetrievalError) else f"{type(exc).__name__}: {exc}"
            )
            with contextlib.suppress(*UNREADABLE):
                await asyncio.to_thread(m.dir.record_error, self.node_id, m.last_error)
            raise
        m.last_run = started
        m.next_run = m.schedule.next_after(started)
        if version is not None:
            m.published += 1
            self._swap(m, version)


def check_value(name: str, value: object) -> bytes | None:
    """What ``retrieve()`` returned, as the bytes to store (None: keep the current value).

    Raises:
        RetrievalError: it is not bytes, or too large.
    """
    if value is None:
        return None
    if isinstance(value, bytearray | memoryview):
        value = bytes(value)
    if not isinstance(value, bytes):
        raise RetrievalError(
            f"retrieve() of side input {name!r} returned {type(value).__name__}; return bytes "
            "(encode text or JSON yourself) or None to keep the current value"
        )
    if len(value) > MAX_SIDE_INPUT_BYTES:
        raise RetrievalError(
            f"retrieve() of side input {name!r} returned {len(value):,} bytes, more than the "
            f"limit of {MAX_SIDE_INPUT_BYTES:,}; keep side inputs small (configuration, lookup "
            "tables) and put larger data in a table"
        )
    return value
