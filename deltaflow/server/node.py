"""The deltaflow node: an aiohttp app serving client streams and applying them to tables."""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..engines import DEFAULT_ENGINE, check_engine, new_engine
from ..errors import UsageError
from ..partitioning import DEFAULT_PARTITIONS, PartitionMap
from ..protocol import DEFAULT_MAX_FRAME_BYTES, PROTOCOL_VERSION, WS_PATH
from ..receivers.dead_letter import DeadLetter
from ..receivers.registry import ReceiverRegistry
from ..receivers.side_input import SideInput
from ..receivers.table import TableUpsert
from ..security import NodeTls, is_loopback, peer_proof
from ..spark_integration.session import SparkConfig
from ..spark_integration.spark_engine import SPARK_WRITERS
from ..storage.conditional import require_conditional_writes
from ..storage.paths import StorePath, location
from ..tables.engine import TableEngine
from ..tables.engine_settings import (
    DEFAULT_MAX_GROUP_BYTES,
    DEFAULT_MAX_GROUP_ROWS,
    EngineSettings,
)
from ..tables.settings import default_buckets
from .connection import ClientConnection, token_matches
from .dispatcher import Dispatcher
from .identity import NodeIdentity, load_identity
from .metrics import NodeCollector
from .side_inputs import (
    DEFAULT_SIDE_INPUT_LEASE,
    DEFAULT_SIDE_INPUT_POLL_INTERVAL,
    DEFAULT_SIDE_INPUT_TIMEOUT,
    SideInputStore,
    load_side_inputs,
)
from .statistics import NodeStatistics
from .topology import DEFAULT_PEER_EXPIRY, Membership

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
        warehouse: where the Delta tables are (one sub-directory or prefix each): a local
            directory, or an object-store URI such as ``s3://bucket/prefix`` (with the delta-rs
            engine; see ``docs/object-storage.md``).
        storage_options: for a warehouse on an object store, its endpoint and credentials by
            delta-rs's option names (``AWS_ENDPOINT_URL``...); the standard environment
            variables apply too. Never logged or shown in status.
        host: interface to listen on. Default ``127.0.0.1``.
        port: TCP port; 0 picks a free one. Default 7700.
        advertise: ``host:port`` clients and peers use to reach this node. Default: ``host`` and
            the bound port; required when ``host`` is a wildcard such as ``0.0.0.0``.
        peers: ``host:port`` of the other nodes.
        receivers: class names (``"module.Class"``) of receivers allowed on this node, besides
            the built-in table receiver.
        receiver_concurrency: receiver name -> the most ``receive`` calls of it running at
            once on this node, overriding the class's ``max_concurrency``.
        token: shared secret clients and peers must present; None disables the check.
        tls: serve TLS, verify peers against its CA, and with ``client_auth`` require
            certificates from clients and peers (see ``docs/security.md``). Default None.
        insecure: let a node listening beyond loopback start with neither a token nor mutual
            TLS, so anyone who reaches it may stream to it or join the cluster. Default False.
        partitions: the fixed partition count; every node of a cluster must agree. Default 64.
        max_frame_bytes: largest frame accepted. Default 16 MiB.
        heartbeat_interval: seconds between peer liveness polls. Default 0.5.
        failure_timeout: seconds of silence after which a peer counts as dead. Default 3.0.
        peer_expiry: seconds of silence after which a peer has left the cluster (shown as
            ``left``; one that is not in ``peers`` is no longer polled). Must exceed
            ``failure_timeout``. Default 60.
        engine: the table engine: ``"spark"`` (default; Delta through PySpark) or
            ``"delta-rs"`` (the ``deltalake`` package, no JVM). Same semantics.
        spark: Spark settings for the Spark engine (``local[*]`` by default).
        spark_writer: how the Spark engine applies a group: ``"direct"`` (default; the node
            writes the data files and commits them through Spark's Delta transaction, no Spark
            job) or ``"sql"`` (a Spark MERGE or INSERT per group). See docs/tables.md.
        max_group_rows: largest group commit, rows. Default 500,000.
        max_group_bytes: largest group commit, bytes of Arrow data. Default 256 MiB. (One batch
            larger than either bound still commits, alone.)
        min_commit_interval: seconds between taking two groups of one table on this node
            for commit, at least; a queue that holds a whole group (``max_group_rows`` or
            ``max_group_bytes``) is taken without waiting. Default 0: a group commits as soon
            as the previous commit ends (see docs/configuration.md, "Commit rate").
        table_buckets: buckets of the keyed tables this node creates on first write; 0 turns
            the bucket layout off. Default None: ``partitions`` if it is at most 64, else its
            largest divisor up to 64 (see docs/tables.md).
        schema_evolution: tables this node creates on first write allow new columns. Default
            False.
        deletion_vectors: tables this node creates on first write get Delta deletion vectors
            (with the delta-rs engine, their groups are applied by merge-on-read; see
            ``docs/tables.md``). Default False.
        side_inputs: class names (``"module.Class"``) of the side inputs this node serves to
            its receivers (see ``docs/side-inputs.md``); every node should list the same.
        side_input_timeout: seconds a starting node waits, once its engine started, for every
            side input to have a value before it fails. Default 60.
        side_input_lease: seconds a side input's leader holds its lease without renewing it
            (renewed every third of it); a dead leader is replaced within 4/3 of it. Default 10.
        side_input_poll_interval: seconds between two checks for a new version of each side
            input. Default 0.5.
    """

    node_id: str
    warehouse: Path | str | StorePath
    storage_options: Mapping[str, str] = field(default_factory=dict, repr=False)
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    advertise: str | None = None
    peers: Sequence[str] = ()
    receivers: Sequence[str] = ()
    receiver_concurrency: Mapping[str, int] = field(default_factory=dict)
    token: str | None = field(default=None, repr=False)
    tls: NodeTls | None = None
    insecure: bool = False
    partitions: int = DEFAULT_PARTITIONS
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    heartbeat_interval: float = 0.5
    failure_timeout: float = 3.0
    peer_expiry: float = DEFAULT_PEER_EXPIRY
    engine: str = DEFAULT_ENGINE
    spark: SparkConfig = field(default_factory=SparkConfig)
    spark_writer: str = SPARK_WRITERS[0]
    max_group_rows: int = DEFAULT_MAX_GROUP_ROWS
    max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES
    min_commit_interval: float = 0.0
    table_buckets: int | None = None
    schema_evolution: bool = False
    deletion_vectors: bool = False
    side_inputs: Sequence[str] = ()
    side_input_timeout: float = DEFAULT_SIDE_INPUT_TIMEOUT
    side_input_lease: float = DEFAULT_SIDE_INPUT_LEASE
    side_input_poll_interval: float = DEFAULT_SIDE_INPUT_POLL_INTERVAL

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
        if not (self.token or (self.tls and self.tls.client_auth) or self.insecure):
            if not is_loopback(self.host):
                raise UsageError(
                    f"node {self.node_id} listens on {self.host!r} with neither a token nor "
                    "mutual TLS, so anyone who reaches it could stream to it or join the "
                    "cluster and take partitions: give it --token-file FILE (with --tls-cert "
                    "and --tls-key, so the token never crosses the network in clear), or "
                    "--tls-client-auth with --tls-ca; --insecure starts it open anyway"
                )
        check_engine(self.engine)
        if self.spark_writer not in SPARK_WRITERS:
            raise UsageError(
                f"spark_writer must be one of {', '.join(SPARK_WRITERS)}, got {self.spark_writer!r}"
            )
        for name, bound in self.receiver_concurrency.items():
            if not isinstance(bound, int) or bound < 1:
                raise UsageError(
                    f"receiver_concurrency[{name!r}] must be a positive int, got {bound!r}"
                )
        if self.failure_timeout <= self.heartbeat_interval:
            raise UsageError("failure_timeout must exceed heartbeat_interval")
        if self.peer_expiry <= self.failure_timeout:
            raise UsageError("peer_expiry must exceed failure_timeout")
        self.engine_settings()  # checks them
        if not (self.side_input_timeout > 0 and self.side_input_poll_interval > 0):
            raise UsageError("side_input_timeout and side_input_poll_interval must be > 0")
        if not self.side_input_lease >= 0.3:
            raise UsageError("side_input_lease must be at least 0.3 seconds")

    def engine_settings(self) -> EngineSettings:
        """The node's table engine settings (its bucket count follows ``partitions`` unless
        ``table_buckets`` is given).

        Raises:
            UsageError: one is out of range.
        """
        buckets = self.table_buckets
        return EngineSettings(
            max_group_rows=self.max_group_rows,
            max_group_bytes=self.max_group_bytes,
            min_commit_interval=self.min_commit_interval,
            table_buckets=default_buckets(self.partitions) if buckets is None else buckets,
            schema_evolution=self.schema_evolution,
            deletion_vectors=self.deletion_vectors,
        )


class NodeState(enum.Enum):
    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


class Node:
    """An embeddable deltaflow node.

    ``await node.start()`` reads (or creates) the warehouse's cluster identity, starts Spark
    (seconds on first use), waits until every side input has a value, listens and joins the
    peers (or is refused by them: see ``docs/cluster.md``, "Cluster identity");
    ``await node.stop()`` closes connections, stops committing and gives up its side-input
    leases. Also an async context manager.

    ``node.metrics`` is the node's own Prometheus registry, served at ``GET /metrics``.
    """

    def __init__(
        self,
        config: NodeConfig,
        *,
        registry: ReceiverRegistry | None = None,
        side_inputs: Sequence[type[SideInput]] = (),
    ) -> None:
        self.config = config
        self.node_id = config.node_id
        self.max_frame_bytes = config.max_frame_bytes
        self.registry = registry or ReceiverRegistry()
        self.registry.register(TableUpsert, TABLE_RECEIVER_NAME)
        self.registry.register(DeadLetter, DEAD_LETTER_RECEIVER_NAME)
        self.registry.register_names(config.receivers)
        self.warehouse = location(config.warehouse, config.storage_options)
        self.engine: TableEngine
        self.engine = new_engine(
            config.engine,
            self.warehouse,
            spark=config.spark,
            spark_writer=config.spark_writer,
            node_id=config.node_id,
            settings=config.engine_settings(),
        )
        # Side inputs, like receivers, are imported here from the operator's list only.
        classes = load_side_inputs([*config.side_inputs, *side_inputs])
        self.side_inputs: SideInputStore | None = None
        if classes:
            self.side_inputs = SideInputStore(
                self.warehouse,
                node_id=config.node_id,
                classes=classes,
                lease=config.side_input_lease,
                poll_interval=config.side_input_poll_interval,
            )
        self.identity: NodeIdentity | None = None  # read by start()
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
            side_inputs=self.side_inputs,
            concurrency=config.receiver_concurrency,
        )
        self.state = NodeState.CREATED
        self.address = f"{config.host}:{config.port}"
        # The node's own registry: several nodes may run in one process.
        self.metrics = CollectorRegistry()
        self.metrics.register(NodeCollector(self.statistics))

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
        """Wait until this node is admitted to its cluster and sees ``count`` live nodes
        (itself included) in its map.

        Raises:
            TimeoutError: not within ``timeout`` seconds.
        """
        if self._membership is None:
            raise UsageError("start the node first")
        async with asyncio.timeout(timeout):
            return await self._membership.wait_for_members(count)

    def _owns(self, partition: int) -> bool:
        # A refused node owns nothing: its map is the cluster's, in which it has no share.
        return self._membership is not None and self._membership.owns(partition)

    def check_token(self, given: str | None) -> bool:
        return token_matches(self.config.token, given)

    def statistics(self) -> NodeStatistics:
        pmap = self.partition_map
        return NodeStatistics(
            node_id=self.node_id,
            state=self.state.value,
            connections=len(self._connections),
            map_version=pmap.version,
            owned_partitions=sum(1 for p in range(pmap.partitions) if self._owns(p)),
            dispatcher=dataclasses.replace(self.dispatcher.stats),
            engine=dataclasses.replace(self.engine.stats),
            side_inputs=self.side_inputs.statistics() if self.side_inputs is not None else (),
        )

    async def start(self) -> None:
        if self.state is not NodeState.CREATED:
            raise UsageError(f"node {self.node_id} was already started")
        try:
            if isinstance(self.warehouse, StorePath):
                # No lock guards commits on a store: its conditional writes must hold.
                await asyncio.to_thread(
                    require_conditional_writes, str(self.warehouse), self.warehouse.storage_options
                )
            identity = await asyncio.to_thread(
                load_identity,
                self.warehouse,
                node_id=self.node_id,
                engine=self.config.engine,
                partitions=self.config.partitions,
            )
            self.identity = identity
            log.info("node %s: %s", self.node_id, identity.describe())
            # Side inputs are retrieved while the engine starts; the node listens only once
            # every side input has a value.
            if self.side_inputs is not None:
                await self.side_inputs.start()
            await self.engine.start()
            if self.side_inputs is not None:
                await self.side_inputs.wait_ready(self.config.side_input_timeout)
        except BaseException:
            self.state = NodeState.STOPPED
            if self.side_inputs is not None:
                await self.side_inputs.stop()
            await self.engine.stop()
            raise
        app = web.Application()
        app.router.add_get(WS_PATH, self._ws_handler)
        app.router.add_get("/v1/cluster", self._cluster_handler)
        app.router.add_get("/healthz", self._health_handler)
        app.router.add_get("/metrics", self._metrics_handler)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=2.0)
        await self._runner.setup()
        tls = self.config.tls
        server_tls = peer_tls = None
        if tls is not None:  # reads the certificate files: off the event loop
            server_tls = await asyncio.to_thread(tls.server_context)
            peer_tls = await asyncio.to_thread(tls.peer_context)
        site = web.TCPSite(self._runner, self.config.host, self.config.port, ssl_context=server_tls)
        await site.start()
        port = self._runner.addresses[0][1]
        self.address = self.config.advertise or f"{self.config.host}:{port}"
        self._membership = Membership(
            node_id=self.node_id,
            address=self.address,
            peers=list(self.config.peers),
            identity=identity,
            heartbeat_interval=self.config.heartbeat_interval,
            failure_timeout=self.config.failure_timeout,
            peer_expiry=self.config.peer_expiry,
            token=self.config.token,
            tls=peer_tls,
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
        if self.side_inputs is not None:
            await self.side_inputs.stop()
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
        membership = self._membership
        peer = request.headers.get("X-Deltaflow-Peer")
        if peer and membership is not None:
            peer_id, _, peer_address = peer.partition("@")
            membership.observe(peer_id, peer_address)
        # Proves to a polling peer that this node holds the token, without sending it.
        token, nonce = self.config.token, request.headers.get("X-Deltaflow-Nonce")
        proof = peer_proof(token, nonce, self.node_id) if token and nonce else None
        return web.json_response(
            {
                "proof": proof,
                "node": self.node_id,
                "address": self.address,
                "protocol": PROTOCOL_VERSION,
                "partitions": self.config.partitions,
                "identity": self.identity.to_wire() if self.identity else None,
                "serving": membership is not None and membership.serving,
                "refused": membership.refusal if membership else None,
                "map": self.partition_map.to_wire(),
                "members": membership.members() if membership else [],
                "receivers": self.registry.names(),
                "side_inputs": {
                    s.name: {"version": s.version, "leader": s.leader}
                    for s in (self.side_inputs.statistics() if self.side_inputs else ())
                },
            }
        )

    async def _health_handler(self, request: web.Request) -> web.Response:
        return web.json_response({"node": self.node_id, "state": self.state.value})

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "wrong or missing token"}, status=401)
        # Not content_type=: aiohttp refuses one with a charset parameter in it.
        return web.Response(
            body=generate_latest(self.metrics), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _ws_handler(self, request: web.Request) -> web.WebSocketResponse:
        # No permessage-deflate: msgpack frames compress little for the CPU it costs.
        ws = web.WebSocketResponse(
            max_msg_size=self.max_frame_bytes, heartbeat=30.0, compress=False
        )
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


async def start_local_nodes(count: int, config: NodeConfig) -> list[Node]:
    """Start ``count`` nodes in this process, ``node-1`` to ``node-<count>``, each with
    ``config`` (its ``node_id`` and ``peers`` replaced), and return once each sees all the
    others: the embedded cluster of the demo, the benchmarks and the tests."""
    nodes: list[Node] = []
    try:
        for i in range(count):
            node = Node(
                dataclasses.replace(
                    config, node_id=f"node-{i + 1}", peers=[n.address for n in nodes]
                )
            )
            await node.start()
            nodes.append(node)
        await asyncio.gather(*(n.wait_for_members(count) for n in nodes))
    except BaseException:
        for node in reversed(nodes):
            await node.stop()
        raise
    return nodes
