"""What a node is told: :class:`NodeConfig`, checked as it is made."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ..engines.options import DEFAULT_ENGINE, EngineOptions, engine_options
from ..errors import SettingsError, UsageError
from ..partitioning import DEFAULT_PARTITIONS
from ..protocol import DEFAULT_MAX_FRAME_BYTES
from ..security import NODE_ID, NodeTls, is_loopback
from ..storage.paths import StorePath
from ..tables.engine import DEFAULT_MAX_TABLES
from ..tables.engine_settings import (
    DEFAULT_COMPACT_INTERVAL,
    DEFAULT_COMPACT_MIN_FILES,
    DEFAULT_MAX_GROUP_BYTES,
    DEFAULT_MAX_GROUP_ROWS,
    CompactionSettings,
    EngineSettings,
)
from ..tables.layout import DEFAULT_BUCKET_ROWS
from ..tables.mark_store import DEFAULT_RANDOM_RETENTION
from ..tables.settings import default_buckets
from .side_inputs import (
    DEFAULT_SIDE_INPUT_LEASE,
    DEFAULT_SIDE_INPUT_POLL_INTERVAL,
    DEFAULT_SIDE_INPUT_TIMEOUT,
)
from .topology import DEFAULT_PEER_EXPIRY

__all__ = ["DEFAULT_PORT", "NodeConfig"]

DEFAULT_PORT: Final = 7700
#: Open connections of a node (clients, peers, probes), at most (see ``listening``).
DEFAULT_MAX_CONNECTIONS: Final = 1024
#: Open connections from one remote address, at most.
DEFAULT_MAX_CONNECTIONS_PER_ADDRESS: Final = 128
#: Seconds a connection has to send a request's headers, whole.
DEFAULT_HEADER_TIMEOUT: Final = 10.0
#: Seconds a kept-alive connection may wait for its next request.
DEFAULT_IDLE_TIMEOUT: Final = 60.0


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
        token: the secret clients present (the client token); None: clients need none.
        peer_token: the secret peers and operators prove (never send) to call the peer
            endpoints: membership, leave, drain. Clients do not hold it. None: under mutual TLS,
            certificates with the peer role prove it; else ``token`` serves (roles not
            separated: only on loopback). See ``docs/security.md``, "Roles".
        tls: serve TLS, verify peers against its CA, and with ``client_auth`` require
            certificates from clients and peers (see ``docs/security.md``). Default None.
        insecure: let a node listening beyond loopback start without a credential, with a
            token but no TLS, or without a peer credential of its own. Default False.
        partitions: the fixed partition count; every node of a cluster must agree. Default 64.
        max_frame_bytes: largest frame accepted. Default 16 MiB.
        max_connections: open connections of the node (clients, peers, probes) at most; more
            are answered 503 as they are accepted. Kept below the open-file limit (see
            ``docs/configuration.md``, "Connections"). Default 1,024.
        max_connections_per_address: open connections from one remote address at most (and
            at most half of ``max_connections``). Default 128.
        header_timeout: seconds a connection has to send a request's headers whole, from its
            accept or, kept alive, from the request's first byte; then it is closed. Default 10.
        idle_timeout: seconds a kept-alive connection may wait for its next request. Default 60.
        heartbeat_interval: seconds between peer liveness polls. Default 0.5.
        failure_timeout: seconds of silence after which a peer counts as dead. Default 3.0.
        peer_expiry: seconds of silence after which a peer has left the cluster (shown as
            ``left``; one that is not in ``peers`` is no longer polled). Must exceed
            ``failure_timeout``. Default 60.
        engine: the table engine: ``"spark"`` (default; Delta through PySpark) or
            ``"delta-rs"`` (the ``deltalake`` package, no JVM), same semantics; or the engine
            with its settings, such as ``SparkOptions(config=SparkConfig(...), writer="sql")``
            (see :mod:`deltaflow.engines.options`). Held as options: a name becomes its
            engine's default options.
        max_tables: tables this node writes at most; a stream's write to one more is
            refused (``OVERLOADED``, not retriable) while the others go on. Default 1,000.
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
        table_bucket_rows: rows per bucket the layout of those tables grows by: a small
            table has one bucket, 2, 4 ... as it grows (docs/tables.md). 0: every bucket
            from the first row. Default 4,096.
        schema_evolution: tables this node creates on first write allow new columns. Default
            False.
        auto_compact: the tables this node commits for their writers are compacted between
            commits: a bucket's small files rewritten into one (docs/tables.md). Default True.
        compact_min_files: small files a bucket must hold before it is compacted. Default 8.
        compact_interval: seconds between two compactions of a table, at least. Default 30.
        random_marks_seconds: seconds this node keeps the lane marks of a stream whose id its
            client made up, after the lane's last commit: at least as long as that client may
            resend one batch. Default 3,600. Other streams' marks are kept for the table's
            ``delta.setTransactionRetentionDuration`` (7 days on the tables deltaflow creates).
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
    peer_token: str | None = field(default=None, repr=False)
    tls: NodeTls | None = None
    insecure: bool = False
    partitions: int = DEFAULT_PARTITIONS
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_connections_per_address: int = DEFAULT_MAX_CONNECTIONS_PER_ADDRESS
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT
    heartbeat_interval: float = 0.5
    failure_timeout: float = 3.0
    peer_expiry: float = DEFAULT_PEER_EXPIRY
    engine: str | EngineOptions = DEFAULT_ENGINE
    max_tables: int = DEFAULT_MAX_TABLES
    max_group_rows: int = DEFAULT_MAX_GROUP_ROWS
    max_group_bytes: int = DEFAULT_MAX_GROUP_BYTES
    min_commit_interval: float = 0.0
    table_buckets: int | None = None
    table_bucket_rows: int = DEFAULT_BUCKET_ROWS
    schema_evolution: bool = False
    deletion_vectors: bool = False
    random_marks_seconds: float = DEFAULT_RANDOM_RETENTION
    auto_compact: bool = True
    compact_min_files: int = DEFAULT_COMPACT_MIN_FILES
    compact_interval: float = DEFAULT_COMPACT_INTERVAL
    side_inputs: Sequence[str] = ()
    side_input_timeout: float = DEFAULT_SIDE_INPUT_TIMEOUT
    side_input_lease: float = DEFAULT_SIDE_INPUT_LEASE
    side_input_poll_interval: float = DEFAULT_SIDE_INPUT_POLL_INTERVAL

    def __post_init__(self) -> None:
        problems: list[str] = []  # every one, so a config check lists them in one pass

        def need(ok: Any, problem: str) -> None:
            if not ok:
                problems.append(problem)

        def checked(check: Callable[[], Any]) -> None:
            try:
                check()
            except UsageError as exc:
                problems.extend(getattr(exc, "problems", None) or [str(exc)])

        need(
            isinstance(self.node_id, str) and NODE_ID.fullmatch(self.node_id),
            f"node_id {self.node_id!r:.80} is not allowed: use 1 to 64 characters of A-Z a-z "
            "0-9 . _ -, starting with a letter or digit",
        )
        for name, secret in (("token", self.token), ("peer_token", self.peer_token)):
            need(secret is None or secret.strip(), f"{name} is empty; a secret must hold something")
        need(1 <= self.partitions <= 65536, "partitions must be between 1 and 65536")
        need(self.max_frame_bytes >= 64 * 1024, "max_frame_bytes must be at least 64 KiB")
        need(
            1 <= self.max_connections_per_address <= self.max_connections,
            "max_connections_per_address must be between 1 and max_connections",
        )
        need(
            self.header_timeout > 0 and self.idle_timeout > 0,
            "header_timeout and idle_timeout must be > 0",
        )
        need(
            self.advertise is not None or self.host not in ("0.0.0.0", "::", ""),
            f"node {self.node_id} listens on all interfaces ({self.host!r}); pass "
            "advertise='host:port' (--advertise) so clients and peers can reach it",
        )
        if not (self.insecure or is_loopback(self.host)):
            checked(self._check_network_credentials)
        checked(lambda: object.__setattr__(self, "engine", engine_options(self.engine)))
        for name, bound in self.receiver_concurrency.items():
            need(
                isinstance(bound, int) and bound >= 1,
                f"receiver_concurrency[{name!r}] must be a positive int, got {bound!r}",
            )
        need(
            self.failure_timeout > self.heartbeat_interval,
            "failure_timeout must exceed heartbeat_interval",
        )
        need(self.peer_expiry > self.failure_timeout, "peer_expiry must exceed failure_timeout")
        checked(self.engine_settings)  # checks them
        need(
            isinstance(self.max_tables, int) and self.max_tables >= 1,
            f"max_tables must be at least 1, got {self.max_tables!r}",
        )
        need(
            self.side_input_timeout > 0 and self.side_input_poll_interval > 0,
            "side_input_timeout and side_input_poll_interval must be > 0",
        )
        need(self.side_input_lease >= 0.3, "side_input_lease must be at least 0.3 seconds")
        if problems:
            raise SettingsError(problems)

    @property
    def peer_certificates(self) -> bool:
        """Peers prove themselves by certificates with the peer role (mutual TLS, no peer
        token)."""
        return self.peer_token is None and self.tls is not None and self.tls.client_auth

    @property
    def peer_secret(self) -> str | None:
        """What peers prove on peer calls: the peer token; else, unless certificates prove
        it, the client token (a loopback cluster without a peer token); else None (open)."""
        if self.peer_token is not None or self.peer_certificates:
            return self.peer_token
        return self.token

    def _check_network_credentials(self) -> None:
        """A node reachable beyond loopback: every role needs a credential, and no secret
        crosses the network in clear."""
        mutual = self.tls is not None and self.tls.client_auth
        fix = "; --insecure starts it anyway"
        if not (self.token or mutual):  # a peer token alone leaves clients unchecked
            raise UsageError(
                f"node {self.node_id} listens on {self.host!r} with neither a token nor "
                "mutual TLS, so anyone who reaches it could stream to it or join the "
                "cluster and take partitions: give it --token-file FILE and --peer-token-file "
                "FILE with --tls-cert and --tls-key, or --tls-client-auth with --tls-ca" + fix
            )
        if (self.token or self.peer_token) and self.tls is None:
            raise UsageError(
                f"node {self.node_id} listens on {self.host!r} with a token but without TLS, "
                "so the client token would cross the network in clear: add --tls-cert and "
                "--tls-key" + fix
            )
        if not (self.peer_token or mutual):
            raise UsageError(
                f"node {self.node_id} listens on {self.host!r} with a client token only, so "
                "any client could act as a peer (change membership, drain nodes): give it "
                "--peer-token-file FILE, a secret only nodes and operators hold, or mutual TLS "
                "with peer certificates" + fix
            )

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
            table_bucket_rows=self.table_bucket_rows,
            schema_evolution=self.schema_evolution,
            deletion_vectors=self.deletion_vectors,
            random_marks_seconds=self.random_marks_seconds,
            compaction=CompactionSettings(
                enabled=self.auto_compact,
                min_files=self.compact_min_files,
                interval=self.compact_interval,
            ),
        )
