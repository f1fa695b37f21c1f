"""The blocking facade for sync code (scripts, Spark executors): same semantics, no asyncio."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Sequence
from typing import Any

from ..errors import UsageError
from ..security import ClientTls
from .changelog import Changelog
from .client import connect
from .ledger import CommitPosition
from .options import StreamerOptions
from .results import OnResult
from .stream_types import KeyFn, StreamSummary

__all__ = ["stream_data"]


def stream_data(
    source: Any,
    *,
    nodes: Sequence[str] | str,
    token: str | None = None,
    tls: ssl.SSLContext | ClientTls | None = None,
    table: str | None = None,
    key: str | Sequence[str] | KeyFn | None = None,
    receiver: str | None = None,
    receiver_args: Any = None,
    on_result: OnResult | None = None,
    on_ack: Callable[[Sequence[Any]], Any] | None = None,
    on_commit: Callable[[CommitPosition], Any] | None = None,
    options: StreamerOptions | None = None,
    stream_id: str | None = None,
    stream_key: str | bytes | None = None,
    sequence_by: str | Sequence[str] | None = None,
    changelog: str | Changelog | None = None,
) -> StreamSummary:
    """Connect, stream ``source`` and return its summary, blocking the calling thread.

    Arguments and errors are those of :meth:`deltaflow.client.Client.stream_data`; ``on_result``
    may be a plain callable. Must not be called from a thread running an event loop (use the
    async client there).

    ``stream_id`` (default: random) names the stream; a deterministic id makes a replay of the
    same input exactly-once (see :meth:`~deltaflow.client.Client.stream_data` for what a
    replay must keep the same), with the same ``stream_key`` (the secret that makes the stream
    the caller's; default: derived from the token).

    Args:
        source: as for :meth:`~deltaflow.client.Client.stream_data`, as are the other
            keyword arguments but the three below.
        nodes: the nodes to connect to, as for :func:`deltaflow.connect`.
        token: the client token, as for :func:`deltaflow.connect`.
        tls: TLS to the nodes, as for :func:`deltaflow.connect`.

    Returns:
        The stream's :class:`~deltaflow.StreamSummary`.

    Raises:
        UsageError: called from a thread that runs an event loop, or the arguments are
            inconsistent.
        DataStreamerError: some items were not applied; ``failed_items`` lists exactly those.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise UsageError(
            "deltaflow.stream_data() blocks and cannot run inside an event loop; use "
            "'async with deltaflow.connect(...) as client: await client.stream_data(...)'"
        )

    async def main() -> StreamSummary:
        async with connect(nodes, token=token, tls=tls) as client:
            return await client.stream_data(
                source,
                table=table,
                key=key,
                receiver=receiver,
                receiver_args=receiver_args,
                on_result=on_result,
                on_ack=on_ack,
                on_commit=on_commit,
                options=options,
                stream_id=stream_id,
                stream_key=stream_key,
                sequence_by=sequence_by,
                changelog=changelog,
            )

    return asyncio.run(main())
