"""The deltaflow node: an aiohttp app serving client streams and applying them to tables."""

from __future__ import annotations

import asyncio
import enum
import logging
import ssl
import time
from collections.abc import Sequence
from typing import Any, Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from ..engines import engine_options, new_engine
from ..errors import UsageError
from ..logs import event
from ..partitioning import PartitionMap
from ..protocol import PROTOCOL_VERSION, WS_PATH, truncated_repr
from ..receivers.dead_letter import DeadLetter
from ..receivers.registry import ReceiverRegistry
from ..receivers.side_input import SideInput
from ..receivers.table import TableUpsert
from ..storage.conditional import require_conditional_writes
from ..storage.paths import StorePath, location
from ..tables.engine import TableEngine
from .commits import CALL_SECONDS, MAX_COMMIT_CALL_BYTES, CommitRouter, read_prepared
from .connection import ClientConnection, serve_websocket, token_matches
from .dispatcher import Dispatcher
from .identity import NodeIdentity, NodeKey, PeerKeys, load_identity
from .listening import Route, listen
from .metrics import NodeCollector
from .node_config import DEFAULT_PORT, NodeConfig
from .peer_gate import PeerGate
from .peers import PeerClient
from .probes import Readiness
from .side_inputs import (
    SideInputStore,
    load_side_inputs,
)
from .statistics import NodeStatistics
from .status import handler as status_handler
from .status import page as status_page
from .status import script as status_script
from .topology import Membership

__all__ = ["DEFAULT_PORT", "Node", "NodeConfig", "NodeState", "NodeStatistics"]

log = logging.getLogger(__name__)

#: Seconds a draining node waits for the batches it accepted to be applied and acknowledged.
DEFAULT_DRAIN_TIMEOUT: Final = 30.0
TABLE_RECEIVER_NAME: Final = "deltaflow.receivers.TableUpsert"
#: Commit bodies parsed at once (a proven peer's 8 MiB of JSON can take ~200 MB to parse).
COMMIT_PARSES: Final = 2
DEAD_LETTER_RECEIVER_NAME: Final = "deltaflow.receivers.DeadLetter"


class NodeState(enum.Enum):
    CREATED = "created"
    STARTING = "starting"  # listening (probes answer), not yet serving
    RUNNING = "running"
    DRAINING = "draining"  # handed its partitions over, finishing what it accepted
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
            engine_options(config.engine),
            self.warehouse,
            node_id=config.node_id,
            settings=config.engine_settings(),
            max_tables=config.max_tables,
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
        self._stopped = asyncio.Event()
        self._drain_task: asyncio.Task[list[str]] | None = None
        self._commit_peers: PeerClient | None = None
        self._commit_router: CommitRouter | None = None
        self._membership: Membership | None = None
        self._runner: web.AppRunner | None = None
        self._connections: set[ClientConnection] = set()
        self._websockets: set[web.WebSocketResponse] = set()
        # Its calls to peers are signed with a key made now; the warehouse holds its public half.
        self.key = NodeKey(config.node_id)
        self._peer_keys = PeerKeys(self.warehouse)  # calls' and answers' signatures: one cache
        self._peer_gate = PeerGate(
            node_id=config.node_id,
            secret=config.peer_secret,
            certificates=config.peer_certificates,
            keys=self._peer_keys,
            signer=self.key,
        )
        self._commit_parsing = asyncio.Semaphore(COMMIT_PARSES)
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
        self.created_at = time.time()
        self.address = f"{config.host}:{config.port}"
        self.readiness = Readiness(
            config.node_id,
            state=lambda: self.state.value,
            serving=lambda: (
                self._membership is not None
                and self._membership.admitted
                and not self._membership.leaving
            ),
        )
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
        (itself included) in its map; TimeoutError if not within ``timeout`` seconds."""
        if self._membership is None:
            raise UsageError("start the node first")
        async with asyncio.timeout(timeout):
            return await self._membership.wait_for_members(count)

    def members(self) -> list[dict[str, Any]]:
        """The members as this node sees it (``/v1/cluster``'s ``members``)."""
        return self._membership.members() if self._membership is not None else []

    def _owns(self, partition: int) -> bool:
        # A refused node owns nothing: its map is the cluster's, in which it has no share.
        return self._membership is not None and self._membership.owns(partition)

    def check_token(self, given: str | None) -> bool:
        """Whether ``given`` may stream and read the map: the client token (or the peer
        token, which operators hold)."""
        peer = self.config.peer_token
        return token_matches(self.config.token, given) or (
            peer is not None and token_matches(peer, given)
        )

    def statistics(self) -> NodeStatistics:
        pmap = self.partition_map
        return NodeStatistics(
            node_id=self.node_id,
            state=self.state.value,
            connections=len(self._connections),
            map_version=pmap.version,
            owned_partitions=sum(1 for p in range(pmap.partitions) if self._owns(p)),
            dispatcher=self.dispatcher.stats.snapshot(),
            engine=self.engine.statistics(),
            side_inputs=self.side_inputs.statistics() if self.side_inputs is not None else (),
        )

    async def start(self) -> None:
        if self.state is not NodeState.CREATED:
            raise UsageError(f"node {self.node_id} was already started")
        self.state = NodeState.STARTING
        ready = self.readiness
        started = time.monotonic()
        try:
            # Listening first: probes answer while the engine starts (everything else 503).
            peer_tls = await self._listen()
            event(log, "node.start", f"node {self.node_id} starting on {self.address}",
                  node=self.node_id, address=self.address, engine=self.engine.name,
                  partitions=self.config.partitions, peers=len(self.config.peers))  # fmt: skip
            if isinstance(self.warehouse, StorePath):
                # No lock guards commits on a store: its conditional writes must hold.
                await asyncio.to_thread(
                    require_conditional_writes, str(self.warehouse), self.warehouse.storage_options
                )
            ready.mark("store")
            identity = await asyncio.to_thread(
                load_identity,
                self.warehouse,
                node_id=self.node_id,
                partitions=self.config.partitions,
            )
            self.identity = identity
            await asyncio.to_thread(self.key.publish, self.warehouse)
            ready.mark("identity")
            log.info("node %s: %s", self.node_id, identity.describe())
            # Side inputs are retrieved while the engine starts; the node serves only once
            # every side input has a value.
            if self.side_inputs is not None:
                await self.side_inputs.start()
            await self.engine.start()
            ready.mark("engine")
            if self.side_inputs is not None:
                await self.side_inputs.wait_ready(self.config.side_input_timeout)
            ready.mark("side_inputs")
        except BaseException:
            self.state = NodeState.STOPPED
            if self.side_inputs is not None:
                await self.side_inputs.stop()
            await self.engine.stop()
            if self._runner is not None:
                await self._runner.cleanup()
            self._stopped.set()
            raise
        if self.config.token and self.config.peer_secret == self.config.token:
            log.warning(
                "node %s: clients and peers share the token, so a client could act as a peer; "
                "give nodes a --peer-token-file of their own",
                self.node_id,
            )
        self._membership = Membership(
            node_id=self.node_id,
            address=self.address,
            peers=list(self.config.peers),
            identity=identity,
            heartbeat_interval=self.config.heartbeat_interval,
            failure_timeout=self.config.failure_timeout,
            peer_expiry=self.config.peer_expiry,
            secret=self.config.peer_secret,
            certificates=self.config.peer_certificates,
            tls=peer_tls,
            receivers=self.registry.names(),
            signer=self.key,
            keys=self._peer_keys,
        )
        await self._membership.start()
        # Prepared groups go to each table's committer (a peer, or this node's own).
        self._commit_peers = PeerClient(
            node_id=self.node_id,
            address=self.address,
            secret=self.config.peer_secret,
            certificates=self.config.peer_certificates,
            tls=peer_tls,
            timeout=CALL_SECONDS,
            signer=self.key,
            keys=self._peer_keys,
        )
        await self._commit_peers.start()
        self._commit_router = CommitRouter(
            node_id=self.node_id,
            engine=self.engine,
            peers=self._commit_peers,
            partition_map=lambda: self.partition_map,
            failure_timeout=self.config.failure_timeout,
            on_failed_call=self._membership.hint,
        )
        self.engine.commit_sink = self._commit_router
        self._membership.map_listeners.append(self._commit_router.ownership.moved)
        ready.mark("membership")
        self.state = NodeState.RUNNING
        event(log, "node.ready", f"node {self.node_id} ready on {self.address}",
              node=self.node_id, address=self.address,
              seconds=round(time.monotonic() - started, 3),
              receivers=list(self.registry.names()))  # fmt: skip

    async def _listen(self) -> ssl.SSLContext | None:
        """Bind the node's port and serve its endpoints (gated until it runs); the context
        its peer calls use, if TLS."""
        routes: list[Route] = [
            ("GET", WS_PATH, self._ws_handler),
            ("GET", "/v1/cluster", self._cluster_handler),
            ("POST", "/v1/peer/poll", self._peer_poll_handler),
            ("POST", "/v1/peer/leave", self._leave_handler),
            ("POST", "/v1/peer/status", self._peer_status_handler),
            ("POST", "/v1/drain", self._drain_handler),
            ("POST", "/v1/peer/commit", self._commit_handler),
            ("GET", "/metrics", self._metrics_handler),
            ("GET", "/", status_page),
            ("GET", "/status.js", status_script),
            ("GET", "/v1/status", status_handler(self)),
        ]
        self._runner, self.address, peer_tls = await listen(self.config, routes, self.readiness)
        return peer_tls

    async def drain(
        self, timeout: float = DEFAULT_DRAIN_TIMEOUT, *, asked_by: str = "embedding"
    ) -> list[str]:
        """Leave the cluster without a pause for anyone, then stop: tell the peers (they take
        this node's partitions at once, no failure timeout), answer every new batch with
        ``NOT_OWNER`` and the map naming the new owners, apply and acknowledge every batch
        already accepted (for at most ``timeout`` seconds), then :meth:`stop`. What SIGTERM
        and ``deltaflow node drain`` do. Returns the peers that took the partitions."""
        if self.state is not NodeState.RUNNING:
            await self.stop()
            return []
        self.state = NodeState.DRAINING
        started = time.monotonic()
        assert self._membership is not None
        told = await self._membership.leave()
        # Clients learn where the partitions went now, not batch by batch from NOT_OWNER.
        moved = self.partition_map.to_wire()
        for conn in self._connections:
            conn.push_map(moved)
        owned = sum(1 for p in range(self.config.partitions) if self._owns(p))
        heirs = sorted(set(self.partition_map.owners) - {self.node_id})
        event(log, "node.drain", f"node {self.node_id} draining (asked by {asked_by}): its "
              f"partitions went to {', '.join(heirs) or 'no one'}"
              + (f" ({owned} kept: no live peer)" if owned else ""),
              level=logging.WARNING if owned else logging.INFO, node=self.node_id,
              asked_by=asked_by, heirs=heirs, kept=owned)  # fmt: skip
        try:
            async with asyncio.timeout(timeout):
                await self.dispatcher.settled()
                await asyncio.gather(*(c.flush() for c in self._connections))
        except TimeoutError:
            log.warning(
                "node %s: batches still unfinished after %gs of draining; their clients "
                "resend them to the new owners",
                self.node_id,
                timeout,
            )
        event(log, "node.drained", f"node {self.node_id} drained in "
              f"{time.monotonic() - started:.2f}s; stopping", node=self.node_id,
              seconds=round(time.monotonic() - started, 3))  # fmt: skip
        await self.stop()
        return told

    async def wait_stopped(self) -> None:
        """Wait until the node has stopped (after :meth:`stop` or a drain)."""
        await self._stopped.wait()

    async def stop(self) -> None:
        if self.state not in (NodeState.RUNNING, NodeState.DRAINING):
            self.state = NodeState.STOPPED
            self._stopped.set()
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
        if self._commit_peers is not None:
            await self._commit_peers.close()
        event(log, "node.stop", f"node {self.node_id} stopped", node=self.node_id)
        self._stopped.set()

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
        """The map and the members, for clients (``GET /v1/cluster``)."""
        if not self._authorised(request):
            return web.json_response({"error": "wrong or missing token"}, status=401)
        if self._membership is not None and request.query.get("unreachable"):
            self._membership.hint(request.query["unreachable"][:300])  # a client's hint
        return web.json_response(self._cluster_body())

    async def _peer_poll_handler(self, request: web.Request) -> web.Response:
        """A peer's liveness poll: it proved itself; it learns this node's view."""
        caller = await self._peer_gate.admit(request, "poll")
        if caller.unverified:  # not observed: the peer token alone does not speak for a node
            body = self._cluster_body(tables=False)
            who = {k: body[k] for k in ("node", "address", "identity", "serving")}
            return self._peer_gate.introduce(request, caller, who)
        if self._membership is not None:
            self._membership.observe(caller.node_id, caller.address)
        # Without the tables: a peer reads none of them, and the answer keeps its size
        # whatever the node writes (each table would add ~180 bytes to every poll).
        return self._peer_gate.answer(caller, self._cluster_body(tables=False))

    async def _peer_status_handler(self, request: web.Request) -> web.Response:
        """What ``GET /v1/cluster`` answers, for an operator proving the peer token (who then
        never sends it); enrols no one."""
        caller = await self._peer_gate.admit(request, "status")
        return self._peer_gate.answer(caller, self._cluster_body())

    def _cluster_body(self, *, tables: bool = True) -> dict[str, object]:
        """This node's view of the cluster; ``tables`` False: without the tables it writes
        or commits (what a peer's poll is answered)."""
        membership = self._membership
        body: dict[str, object] = {
            "draining": self.state is NodeState.DRAINING,
            "node": self.node_id,
            "address": self.address,
            "protocol": PROTOCOL_VERSION,
            "partitions": self.config.partitions,
            "identity": self.identity.to_wire() if self.identity else None,
            "serving": membership is not None and membership.serving,
            "refused": membership.refusal if membership else None,
            "map": self.partition_map.to_wire(),
            "members": self.members(),
            "receivers": self.registry.names(),
            "side_inputs": {
                s.name: {"version": s.version, "leader": s.leader}
                for s in (self.side_inputs.statistics() if self.side_inputs else ())
            },
        }
        if tables:  # the first 10,000 by name, each with its committer by this node's map
            pmap = self.partition_map
            known = self.engine.tables().items()
            body["tables"] = {n: {"committer": pmap.committer(n), **t} for n, t in known}
        return body

    async def _leave_handler(self, request: web.Request) -> web.Response:
        """A peer drains: it asks this node to take its partitions now (taken only if the
        caller is that peer and a poll of it confirms it drains)."""
        caller = await self._peer_gate.admit(request, "leave")
        membership = self._membership
        taken = membership is not None and await membership.departed(caller.node_id, caller.address)
        return self._peer_gate.answer(caller, {"node": self.node_id, "taken": taken})

    async def _commit_handler(self, request: web.Request) -> web.Response:
        """A writer's prepared group, for this node to commit (it is, or was, the table's
        committer); answered with the outcome once the commit holding it is durable."""
        # The proof (in headers, over the body's digest) first: a stranger's body is not read.
        limit = MAX_COMMIT_CALL_BYTES
        caller = await self._peer_gate.admit_unread(request, "commit", limit=limit)
        data = await self._peer_gate.read_proven(request, caller, limit)
        async with self._commit_parsing:
            prepared = await asyncio.to_thread(read_prepared, data)
        del data
        if isinstance(prepared, str):
            log.info("refused a commit call from %s: %s", caller, truncated_repr(prepared))
            return web.json_response({"error": f"a bad prepared commit: {prepared}"}, status=400)
        if prepared.writer != caller.node_id:
            return web.json_response(
                {"error": "a node sends its own prepared groups only"}, status=403
            )
        if self.state is not NodeState.RUNNING and self.state is not NodeState.DRAINING:
            return web.json_response({"error": f"node {self.node_id} stopped"}, status=503)
        committer = await self.engine.existing_committer(prepared.table)
        if committer is None:
            return web.json_response(
                {"error": f"no table {prepared.table!r} in this node's warehouse"}, status=404
            )
        assert self._commit_router is not None
        outcome = await committer.submit(prepared, self._commit_router.ownership)
        return self._peer_gate.answer(caller, {"node": self.node_id, "outcome": outcome.to_wire()})

    async def _drain_handler(self, request: web.Request) -> web.Response:
        """``deltaflow node drain``, by an operator holding the peer credential: hand the
        partitions over, finish, stop."""
        caller = await self._peer_gate.admit(request, "drain")
        if self.state is NodeState.RUNNING:
            asked_by = f"{caller} from {request.remote}"
            self._drain_task = asyncio.create_task(
                self.drain(asked_by=asked_by), name="deltaflow-drain"
            )
        response = self._peer_gate.answer(caller, {"node": self.node_id, "state": self.state.value})
        response.set_status(202)
        return response

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        if not self._authorised(request):
            return web.json_response({"error": "wrong or missing token"}, status=401)
        # Not content_type=: aiohttp refuses one with a charset parameter in it.
        return web.Response(
            body=generate_latest(self.metrics), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _ws_handler(self, request: web.Request) -> web.StreamResponse:
        return await serve_websocket(self, request, self._connections, self._websockets)
