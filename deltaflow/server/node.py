"""The deltaflow node: an aiohttp app serving client streams and applying them to tables."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from aiohttp import web

from ..errors import UsageError
from ..partitioning import DEFAULT_PARTITIONS, PartitionMap
from ..protocol import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, WS_PATH
from ..receivers.dead_letter import DeadLetter
from ..receivers.registry import ReceiverRegistry
from ..receivers.table import TableUpsert
from ..spark_integration.deltars_engine import DeltaRsTableEngine
from ..spark_integration.engine import EngineStatistics, TableEngine
from ..spark_integration.session import SparkConfig
from ..spark_integration.spark_engine import SparkTableEngine
from .connection import ClientConnection, token_matches
from .dispatcher import Dispatcher, DispatcherStatistics
from .topology import Membership

__all__ = ["DEFAULT_PORT", "Node", "NodeConfig", "NodeState", "NodeStatistics"]

log = logging.getLogger(__name__)

DEFAULT_PORT: Final = 7700
TABLE_RECEIVER_NAME: Final = "deltaflow.receivers.TableUpsert"
DEAD_LETTER_RECEIVER_NAME: Final = "deltaflow.receivers.DeadLetter"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeConfig:
    """Settings of one node.

    Attributes:
        node_id: unique, stable name of the node in the cluster.
        warehouse: directory holding the Delta tables (one sub-directory each).
        host: interface to listen on. Default ``127.0.0.1``.
        port: TCP port; 0 picks a free one. Default 7700.
        advertise: ``host:port`` clients and peers use to reach this node. Default: ``host`` and
            the bound port; required when ``host`` is a wildcard such as ``0.0.0.0``.
        peers: ``host:port`` of the other nodes.
        receivers: class names (``"module.Class"``) of receivers allowed on this node, besides
            the built-in table receiver.
        token: shared secret clients and peers must present; None disables the check.
        partitions: the fixed partition count; every node of a cluster must agree. Default 64.
        max_frame_bytes: largest frame accepted. Default 16 MiB.
        heartbeat_interval: seconds between peer liveness polls. Default 0.5.
        failure_timeout: seconds of silence after which a peer counts as dead. Default 3.0.
        engine: the table engine: ``"spark"`` (default; Delta through PySpark) or
            ``"delta-rs"`` (the ``deltalake`` package, no JVM). Same semantics.
        spark: Spark settings for the Spark engine (``local[*]`` by default).
        max_group_rows: largest group commit, rows. Default 500,000.
    """

    node_id: str
    warehouse: Path
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    advertise: str | None = None
    peers: Sequence[str] = ()
    receivers: Sequence[str] = ()
    token: str | None = None
    partitions: int = DEFAULT_PARTITIONS
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    heartbeat_interval: float = 0.5
    failure_timeout: float = 3.0
    engine: str = "spark"
    spark: SparkConfig = field(default_factory=SparkConfig)
    max_group_rows: int = 500_000

    def __post_init__(self) -> None:
        if not self.node_id or "@" in self.node_id:
            raise UsageError(f"node_id {self.node_id!r} must be a non-empty name without '@'")
        if not 1 <= self.partitions <= 65536:
            raise UsageError("partitions must be between 1 and 65536")
        if self.max_frame_bytes < 64 * 1024:
            raise UsageError("max_frame_bytes must be at least 64 KiB")
        if self.advertise is None and self.host in ("0.0.0.0", "::", ""):
            raise UsageError(
                f"node {self.node_id} listens on all interfaces ({self.host!r}); pass "
                "advertise='host:port' (--advertise) so clients and peers can reach it"
            )
        if self.engine not in ("spark", "delta-rs"):
            raise UsageError(f"engine must be 'spark' or 'delta-rs', got {self.engine!r}")
        if self.failure_timeout <= self.heartbeat_interval:
            raise UsageError("failure_timeout must exceed heartbeat_interval")


class NodeState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeStatistics:
    """A snapshot of a node's counters."""

    node_id: str
    state: str
    connections: int
    map_version: int
    owned_partitions: int
    dispatcher: DispatcherStatistics
    engine: EngineStatistics


class Node:
    """An embeddable deltaflow node.

    ``await node.start()`` starts Spark (seconds on first use), joins the peers and listens;
    ``await node.stop()`` closes connections and stops committing. Also an async context
    manager.
    """

    def __init__(self, config: NodeConfig, *, registry: ReceiverRegistry | None = None) -> None:
        self.config = config
        self.node_id = config.node_id
        self.max_frame_bytes = config.max_frame_bytes
        self.registry = registry or ReceiverRegistry()
        self.registry.register(TableUpsert, TABLE_RECEIVER_NAME)
        self.registry.register(DeadLetter, DEAD_LETTER_RECEIVER_NAME)
        self.registry.register_names(config.receivers)
        self.engine: TableEngine
        if config.engine == "spark":
            self.engine = SparkTableEngine(
                Path(config.warehouse),
                node_id=config.node_id,
                spark=config.spark,
                max_group_rows=config.max_group_rows,
            )
        else:
            self.engine = DeltaRsTableEngine(
                Path(config.warehouse), node_id=config.node_id, max_group_rows=config.max_group_rows
            )
        self._membership: Membership | None = None
        self._runner: web.AppRunner | None = None
        self._connections: set[ClientConnection] = set()
        self._websockets: set[web.WebSocketResponse] = set()
        self.dispatcher = Dispatcher(
            node_id=config.node_id,
            registry=self.registry,
            writer=self.engine,
            owns=self._owns,
            map_wire=lambda: self.partition_map.to_wire(),
            partitions=config.partitions,
        )
        self.state = NodeState.CREATED
        self.address = f"{config.host}:{config.port}"

    def __repr__(self) -> str:
        return (
            f"<Node {self.node_id} {self.state.value} at {self.address} "
            f"connections={len(self._connections)} streams={self.dispatcher.stats.streams}>"
        )

    @property
    def partition_map(self) -> PartitionMap:
        if self._membership is None:
            return PartitionMap.build(0, {self.node_id: self.address}, self.config.partitions)
        return self._membership.map

    async def wait_for_members(self, count: int, *, timeout: float = 30.0) -> PartitionMap:
        """Wait until this node sees ``count`` live nodes (itself included) in its map.

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        if self._membership is None:
            raise UsageError("start the node first")
        async with asyncio.timeout(timeout):
            return await self._membership.wait_for_members(count)

    def _owns(self, partition: int) -> bool:
        return self.partition_map.owners[partition] == self.node_id

    def check_token(self, given: str | None) -> bool:
        return token_matches(self.config.token, given)

    def statistics(self) -> NodeStatistics:
        pmap = self.partition_map
        return NodeStatistics(
            node_id=self.node_id,
            state=self.state.value,
            connections=len(self._connections),
            map_version=pmap.version,
            owned_partitions=sum(1 for o in pmap.owners if o == self.node_id),
            dispatcher=dataclasses.replace(self.dispatcher.stats),
            engine=dataclasses.replace(self.engine.stats),
        )

    async def start(self) -> None:
        if self.state is not NodeState.CREATED:
            raise UsageError(f"node {self.node_id} was already started")
        await self.engine.start()
        app = web.Application()
        app.router.add_get(WS_PATH, self._ws_handler)
        app.router.add_get("/v1/cluster", self._cluster_handler)
        app.router.add_get("/healthz", self._health_handler)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = self._runner.addresses[0][1]
        self.address = self.config.advertise or f"{self.config.host}:{port}"
        headers = {"Authorization": f"Bearer {self.config.token}"} if self.config.token else {}
        self._membership = Membership(
            node_id=self.node_id,
            address=self.address,
            peers=list(self.config.peers),
            partitions=self.config.partitions,
            heartbeat_interval=self.config.heartbeat_interval,
            failure_timeout=self.config.failure_timeout,
            headers=headers,
        )
        await self._membership.start()
        self.state = NodeState.RUNNING
        log.info(
            "node %s listening on %s (receivers: %s)",
            self.node_id,
            self.address,
            ", ".join(self.registry.names()),
        )

    async def stop(self) -> None:
        if self.state is not NodeState.RUNNING:
            self.state = NodeState.STOPPED
            return
        self.state = NodeState.STOPPED
        if self._membership is not None:
            await self._membership.stop()
        for ws in list(self._websockets):
            await ws.close()
        await self.dispatcher.stop()
        if self._runner is not None:
            await self._runner.cleanup()
        await self.engine.stop()

    async def __aenter__(self) -> Node:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # -- HTTP handlers --------------------------------------------------------------------

    def _authorised(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        given = header.removeprefix("Bearer ") if header.startswith("Bearer ") else None
        return self.check_token(given)

    async def _cluster_handler(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "wrong or missing token"}, status=401)
        peer = request.headers.get("X-Deltaflow-Peer")
        if peer and self._membership is not None:
            peer_id, _, peer_address = peer.partition("@")
            self._membership.observe(peer_id, peer_address)
        return web.json_response(
            {
                "node": self.node_id,
                "address": self.address,
                "protocol": PROTOCOL_VERSION,
                "partitions": self.config.partitions,
                "map": self.partition_map.to_wire(),
                "members": self._membership.members() if self._membership else [],
                "receivers": self.registry.names(),
            }
        )

    async def _health_handler(self, request: web.Request) -> web.Response:
        return web.json_response({"node": self.node_id, "state": self.state.value})

    async def _ws_handler(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=self.max_frame_bytes, heartbeat=30.0)
        await ws.prepare(request)
        conn = ClientConnection(self, ws, request.remote or "?")
        self._connections.add(conn)
        self._websockets.add(ws)
        try:
            await conn.serve()
        finally:
            self._connections.discard(conn)
            self._websockets.discard(ws)
            if not ws.closed:
                await ws.close()
        return ws
