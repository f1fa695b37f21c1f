"""The router: the client's partition map and its connections, one per node.

A sender sees the router through :class:`Routes` and a stream through :class:`StreamRoutes`
(protocols, so tests can route to scripted connections); :class:`Router` is the client's
implementation. Neither a sender nor a stream knows the :class:`~deltaflow.client.Client`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Protocol

import aiohttp

from ..errors import (
    AuthenticationError,
    DeltaflowError,
    NodeUnavailableError,
    TransportError,
    UnknownReceiverError,
    UsageError,
)
from ..partitioning import PartitionMap
from ..security import ClientTls, client_context, url
from .connection import Connection, explain_dropped, map_transport_errors

__all__ = ["ConnectionFactory", "Router", "Routes", "StreamRoutes", "fetch_cluster"]

#: Seconds between two looks at which nodes serve a stream's receiver, while it waits.
RECEIVER_POLL_SECONDS: Final = 0.5

log = logging.getLogger(__name__)

#: Opens a handshaken connection to ``address``; the seam fault-injecting tests replace.
ConnectionFactory = Callable[..., Awaitable[Connection]]


class Routes(Protocol):
    """What a sender needs: the connection to each partition's owner, and a way to report
    that the partition map is out of date."""

    def connection_now(self, partition: int) -> Connection | None:
        """The open connection to the partition's owner if there is one and the map is not
        stale; None otherwise (then :meth:`connection_for` waits for one)."""
        ...

    async def connection_for(self, partition: int) -> Connection:
        """The connection to the partition's owner, refreshing a stale map and connecting
        first if need be."""
        ...

    def connection_to(self, node_id: str) -> Connection | None:
        """The open connection to node ``node_id``, if there is one."""
        ...

    def adopt_map(self, wire: Any) -> None:
        """Take the map a ``NOT_OWNER`` answer carried (wire form, or None) if it is newer;
        otherwise mark the map stale."""
        ...

    def mark_stale(self) -> None:
        """The map may be out of date (a node was lost): refresh it before the next send."""
        ...


class StreamRoutes(Routes, Protocol):
    """What a stream needs besides its senders' routes."""

    async def await_receiver(self, receiver: str, wait: float) -> None:
        """Return once every live node serves ``receiver`` (see :meth:`Router.await_receiver`)."""
        ...

    @property
    def partitions(self) -> int:
        """The cluster's partition count."""
        ...

    async def close_stream(self, sid: str, *, keep_results: bool = False) -> None:
        """Tell every connected node that stream ``sid`` ends (see
        :meth:`Connection.close_stream`)."""
        ...


class Router:
    """Learns and refreshes the partition map and keeps one :class:`Connection` per node.

    A map that comes with a ``NOT_OWNER`` error replaces the current one only if its version
    is higher; otherwise the map is marked stale and fetched again from the cluster.

    Args:
        bootstrap: node addresses (``host:port``) to learn the map from.
        token: the nodes' shared secret, or None.
        tls: how to reach the nodes over TLS (``https``/``wss``): an SSL context, or the
            files to build one with (read by :meth:`start`, off the event loop); None: plain.
        connection_factory: opens a connection (default :meth:`Connection.open`).
        connect_timeout: seconds to connect or fetch a map.
    """

    def __init__(
        self,
        bootstrap: Sequence[str],
        *,
        token: str | None,
        tls: ssl.SSLContext | ClientTls | None = None,
        connection_factory: ConnectionFactory | None = None,
        connect_timeout: float = 10.0,
    ) -> None:
        self._bootstrap = list(bootstrap)
        self._token = token
        self._tls_option = tls
        self._tls: ssl.SSLContext | None = None
        self._factory = connection_factory or Connection.open
        self._connect_timeout = connect_timeout
        self._client_id = uuid.uuid4().hex
        self._map: PartitionMap | None = None
        self._stale = False
        #: A node this client could not reach: named to the next node asked for the map, which
        #: then polls it at once (a dead node's partitions move sooner).
        self._unreachable: str | None = None
        self._conns: dict[str, Connection] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._refresh_lock = asyncio.Lock()
        self._closed = False

    @property
    def partition_map(self) -> PartitionMap:
        if self._map is None:
            raise UsageError("the client is not connected; use 'async with deltaflow.connect(...)'")
        return self._map

    @property
    def partitions(self) -> int:
        return self.partition_map.partitions

    @property
    def map_version(self) -> int | None:
        return self._map.version if self._map else None

    @property
    def nodes(self) -> int:
        """Nodes in the map (0 before one is learnt)."""
        return len(self._map.addresses) if self._map else 0

    @property
    def connections(self) -> int:
        """Connections held, open or not."""
        return len(self._conns)

    @property
    def open_connections(self) -> int:
        return sum(1 for c in self._conns.values() if not c.closed)

    async def start(self) -> None:
        """Learn the map from the bootstrap nodes.

        Raises:
            NodeUnavailableError: none of them could be reached.
            UsageError: a TLS file cannot be read.
        """
        if self._tls is None and self._tls_option is not None:
            self._tls = await asyncio.to_thread(client_context, self._tls_option)
        await self.refresh_map(self._bootstrap)

    async def close(self) -> None:
        """Close every connection; no new one is opened afterwards."""
        self._closed = True
        conns, self._conns = list(self._conns.values()), {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)

    # -- Routes and StreamRoutes ------------------------------------------------------------

    async def connection_for(self, partition: int) -> Connection:
        if self._stale:
            await self.refresh_map(only_if_stale=True)
        address = self.partition_map.owner_address(partition)
        try:
            return await self._connection(address)
        except NodeUnavailableError:
            self._stale = True
            self._unreachable = address
            raise

    def connection_now(self, partition: int) -> Connection | None:
        if self._stale:
            return None
        conn = self._conns.get(self.partition_map.owner_address(partition))
        return conn if conn is not None and not conn.closed else None

    def adopt_map(self, wire: Any) -> None:
        if wire is None:
            self._stale = True
            return
        try:
            offered = PartitionMap.from_wire(wire)
        except ValueError:
            self._stale = True
            return
        if self._map is None or offered.version > self._map.version:
            log.info(
                "partition map v%d adopted: nodes %s", offered.version, sorted(offered.addresses)
            )
            self._map = offered
        else:  # the node's view is not newer than ours: ask the cluster again
            self._stale = True

    def connection_to(self, node_id: str) -> Connection | None:
        for conn in self._conns.values():
            if conn.node_id == node_id and not conn.closed:
                return conn
        return None

    def offer_map(self, wire: Any) -> None:
        """A node pushed its map (it drains): take it if it is newer than ours."""
        try:
            offered = PartitionMap.from_wire(wire)
        except ValueError:
            return
        if self._map is None or offered.version > self._map.version:
            log.info(
                "partition map v%d pushed: nodes %s", offered.version, sorted(offered.addresses)
            )
            self._map = offered
            self._stale = False

    def mark_stale(self) -> None:
        self._stale = True

    async def close_stream(self, sid: str, *, keep_results: bool = False) -> None:
        for conn in list(self._conns.values()):
            await conn.close_stream(sid, keep_results=keep_results)

    # -- connections and the map ----------------------------------------------------------

    async def _connection(self, address: str) -> Connection:
        conn = self._conns.get(address)
        if conn is not None and not conn.closed:
            return conn
        lock = self._connecting.setdefault(address, asyncio.Lock())
        async with lock:
            conn = self._conns.get(address)
            if conn is None or conn.closed:
                if self._closed:
                    raise UsageError("the client is closed")
                conn = await self._factory(
                    address,
                    token=self._token,
                    client_id=self._client_id,
                    timeout=self._connect_timeout,
                    tls=self._tls,
                )
                conn.on_map = self.offer_map
                self._conns[address] = conn
            return conn

    async def await_receiver(self, receiver: str, wait: float) -> None:
        """Return once every live node says it serves ``receiver``, waiting up to ``wait``
        seconds while some do and some do not yet (a rolling restart adding it); nodes that do
        not say what they serve (older ones) are not waited for.

        A receiver no node serves returns at once: the nodes refuse the stream's first
        batches themselves, naming the receivers they do serve.

        Raises:
            UnknownReceiverError: after the wait some live nodes still do not serve it; the
                message names them.
        """
        deadline = time.monotonic() + wait
        while True:
            serving, missing = await self._receiver_view(receiver)
            if not (missing and serving):
                return
            if time.monotonic() >= deadline:
                where = ", ".join(f"{n} ({a})" for n, a in sorted(missing.items()))
                raise UnknownReceiverError(
                    f"receiver {receiver!r} is served by {', '.join(sorted(serving))} but not "
                    f"by {where} after {wait:g}s: start every node with --receiver {receiver} "
                    "(receivers in its config) before streaming to it; nothing was taken from "
                    "the source"
                )
            await asyncio.sleep(RECEIVER_POLL_SECONDS)

    async def _receiver_view(self, receiver: str) -> tuple[list[str], dict[str, str]]:
        """(live nodes serving ``receiver``, {live node lacking it: address}) as the first
        node that answers sees them; nodes that do not list their receivers are left out."""
        addresses = list(self._map.addresses.values()) if self._map else []
        for address in [*addresses, *self._bootstrap]:
            try:
                body = await fetch_cluster(address, self._token, self._connect_timeout, self._tls)
            except (DeltaflowError, OSError, ValueError):
                continue
            serving: list[str] = []
            missing: dict[str, str] = {}
            for m in body.get("members") or []:
                if isinstance(m, dict) and m.get("state") == "live":
                    served = m.get("receivers")
                    if isinstance(served, list) and receiver in served:
                        serving.append(str(m.get("node")))
                    elif isinstance(served, list):
                        missing[str(m.get("node"))] = str(m.get("address"))
            return serving, missing
        return [], {}  # no node answers: the stream's own sends say so

    async def refresh_map(
        self, candidates: Sequence[str] | None = None, *, only_if_stale: bool = False
    ) -> None:
        """Fetch the map from the first node that answers: ``candidates`` first, then the
        nodes of the current map, then the bootstrap nodes.

        Raises:
            NodeUnavailableError: no node answered.
        """
        async with self._refresh_lock:
            if only_if_stale and not self._stale:
                return  # another batch refreshed it while we waited for the lock
            addresses = list(candidates or [])
            if self._map is not None:
                addresses += [a for a in self._map.addresses.values() if a not in addresses]
            addresses += [a for a in self._bootstrap if a not in addresses]
            errors: list[str] = []
            unreachable, self._unreachable = self._unreachable, None
            if unreachable in addresses:  # asked last: it just could not be reached
                addresses = [a for a in addresses if a != unreachable] + [unreachable]
            for address in addresses:
                try:
                    fresh = PartitionMap.from_wire(
                        await _fetch_map(
                            address, self._token, self._connect_timeout, self._tls, unreachable
                        )
                    )
                    if self._map is None or fresh.version != self._map.version:
                        log.info(
                            "partition map v%d from %s: nodes %s",
                            fresh.version,
                            address,
                            sorted(fresh.addresses),
                        )
                    self._map = fresh
                    self._stale = False
                    return
                except (DeltaflowError, ValueError) as exc:
                    if not getattr(exc, "retriable", True):
                        raise
                    errors.append(f"{address}: {exc}")
            raise NodeUnavailableError(
                "no deltaflow node reachable to learn the partition map (" + "; ".join(errors) + ")"
            )


async def fetch_cluster(
    address: str,
    token: str | None,
    timeout: float,
    tls: ssl.SSLContext | None,
    unreachable: str | None = None,
) -> dict[str, Any]:
    """The node's ``/v1/cluster`` answer (its map, members, identity). In plain text the first
    request goes without the token: only a node that answers plain HTTP (with 401) is sent it,
    so a client that forgot ``tls=`` never sends the token to a TLS node's port in clear.

    Raises:
        NodeUnavailableError, ConnectionLostError: the node cannot be reached.
        AuthenticationError: the node rejected ``token``.
        TlsError: TLS failed, or the node serves TLS and ``tls`` is None.
    """
    try:
        with map_transport_errors(address, tls):
            async with aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=timeout)
            ) as session:
                first_token = token if tls is not None else None
                status, body = await _get_cluster(session, address, first_token, tls, unreachable)
                if status == 401 and token and tls is None:
                    status, body = await _get_cluster(session, address, token, tls, unreachable)
    except TransportError as exc:
        await explain_dropped(address, exc, tls)
        raise
    if status == 401:
        raise AuthenticationError(
            f"node at {address} rejected the token; pass the token from the node's "
            "--token-file to deltaflow.connect(token=...)"
        )
    if status != 200 or not isinstance(body, dict):
        raise NodeUnavailableError(f"node at {address} answered {status} for its map")
    return body


async def _get_cluster(
    session: aiohttp.ClientSession,
    address: str,
    token: str | None,
    tls: ssl.SSLContext | None,
    unreachable: str | None,
) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    params = {"unreachable": unreachable} if unreachable else None
    async with session.get(
        url(address, "/v1/cluster", tls),
        headers=headers,
        params=params,
        ssl=tls if tls is not None else True,
    ) as resp:
        return resp.status, (await resp.json() if resp.status == 200 else None)


async def _fetch_map(
    address: str,
    token: str | None,
    timeout: float,
    tls: ssl.SSLContext | None,
    unreachable: str | None = None,
) -> dict[str, Any]:
    body = await fetch_cluster(address, token, timeout, tls, unreachable)
    if body.get("refused"):
        # Its map is the cluster's (it owns no partition in it), so it is still usable.
        log.warning("node at %s is refused by its cluster: %s", address, body["refused"])
    return body["map"]  # type: ignore[no-any-return]
