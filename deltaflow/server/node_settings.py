"""Every setting of ``deltaflow serve``: its key in the config file, its variable, its flag,
type, default and help (:data:`SETTINGS`, the one list of them). How the sources are layered
is :mod:`.config_layers`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["BY_KEY", "ENV_PREFIX", "SECTIONS", "SETTINGS", "Kind", "Setting"]

ENV_PREFIX: Final = "DELTAFLOW_"

Kind = Literal["str", "int", "float", "bool", "list", "map", "int-map", "path", "secret"]


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: its key in the file (dotted for a section), type, default and help.

    ``flag`` None: not settable on the command line (secrets). ``default`` None with
    ``required``: the node cannot start without it.
    """

    key: str
    kind: Kind
    help: str
    default: Any = None
    flag: str | None = ""  # "": derived from the key
    required: bool = False
    choices: tuple[str, ...] = ()
    metavar: str | None = None

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.replace(".", "_").upper()

    @property
    def option(self) -> str | None:
        """The command-line flag, or None."""
        if self.flag is None:
            return None
        return self.flag or "--" + self.key.replace(".", "-").replace("_", "-")

    @property
    def dest(self) -> str:
        return "setting_" + self.key.replace(".", "__")


def _settings() -> tuple[Setting, ...]:
    from ..engines.options import DEFAULT_ENGINE, ENGINE_NAMES, SPARK_WRITERS, SparkOptions
    from ..spark_integration.session import SparkConfig
    from .node_config import NodeConfig

    node = {f.name: f.default for f in dataclasses.fields(NodeConfig)}
    spark = {f.name: f.default for f in dataclasses.fields(SparkConfig)}
    writer = {f.name: f.default for f in dataclasses.fields(SparkOptions)}["writer"]
    S = Setting
    return (
        S("node_id", "str", "unique, stable name of this node in the cluster", required=True,
          metavar="ID"),
        S("warehouse", "str", "where the tables are: a directory or s3://bucket/prefix",
          required=True, metavar="DIR|URI"),
        S("storage_options", "map", "object-store settings by delta-rs's names "
          "(AWS_ENDPOINT_URL...); env: one variable per option, DELTAFLOW_STORAGE_OPTIONS_<NAME>;"
          " secrets only from the file or the environment", {}, flag="--storage-option",
          metavar="NAME=VALUE"),
        S("host", "str", "interface to listen on", node["host"], metavar="HOST"),
        S("port", "int", "TCP port (0: any free one)", node["port"]),
        S("advertise", "str", "host:port clients and peers reach this node at (needed when "
          "host is 0.0.0.0)", metavar="HOST:PORT"),
        S("peers", "list", "the other nodes, host:port (comma-separated on the command line)",
          [], metavar="HOST:PORT,..."),
        S("receivers", "list", "receiver classes (module.Class) allowed on this node "
          "(repeatable)", [], flag="--receiver", metavar="module.Class"),
        S("receiver_concurrency", "int-map", "at most N receive() calls of receiver NAME at "
          "once on this node (repeatable)", {}, metavar="NAME=N"),
        S("token_file", "path", "file holding the client token (clients present it)"),
        S("peer_token_file", "path", "file holding the peer token (nodes and operators prove "
          "it to change membership or drain; clients never hold it)"),
        S("token", "secret", "the client token itself (environment only)", flag=None),
        S("peer_token", "secret", "the peer token itself (environment only)", flag=None),
        S("tls.cert", "path", "serve TLS with this certificate (PEM)"),
        S("tls.key", "path", "the key of tls.cert (PEM)"),
        S("tls.ca", "path", "the CA peers' and clients' certificates must chain to (PEM)"),
        S("tls.client_auth", "bool", "require a certificate signed by tls.ca from every client "
          "and peer (mutual TLS)", False),
        S("insecure", "bool", "UNSAFE: listen beyond loopback without a credential, TLS or a "
          "peer credential", False),
        S("partitions", "int", "the cluster's partition count (every node the same)",
          node["partitions"]),
        S("engine", "str", "the table engine", DEFAULT_ENGINE, choices=ENGINE_NAMES),
        S("max_frame_bytes", "int", "largest frame accepted, bytes", node["max_frame_bytes"]),
        S("max_connections", "int", "open connections of the node at most (kept below the "
          "open-file limit)", node["max_connections"]),
        S("max_connections_per_address", "int", "open connections from one remote address at "
          "most", node["max_connections_per_address"]),
        S("header_timeout", "float", "seconds a connection has to send a request's headers",
          node["header_timeout"]),
        S("idle_timeout", "float", "seconds a kept-alive connection may wait for its next "
          "request", node["idle_timeout"]),
        S("heartbeat_interval", "float", "seconds between peer liveness polls",
          node["heartbeat_interval"]),
        S("failure_timeout", "float", "seconds of silence after which a peer is dead",
          node["failure_timeout"]),
        S("peer_expiry", "float", "seconds of silence after which a peer has left (more than "
          "failure_timeout)", node["peer_expiry"]),
        S("max_tables", "int", "tables this node writes at most (a write to one more is "
          "refused)", node["max_tables"]),
        S("max_group_rows", "int", "largest group commit, rows", node["max_group_rows"]),
        S("max_group_bytes", "int", "largest group commit, bytes of Arrow data",
          node["max_group_bytes"]),
        S("min_commit_interval", "float", "seconds between two commits of a table on this "
          "node, at least, unless a whole group is queued", node["min_commit_interval"]),
        S("table_buckets", "int", "buckets of keyed tables created on first write (0: no "
          "bucket layout; unset: from the partition count)"),
        S("table_bucket_rows", "int", "rows per bucket the layout of those tables grows by "
          "(0: every bucket from the first row)", node["table_bucket_rows"]),
        S("schema_evolution", "bool", "tables created on first write accept new columns",
          False),
        S("deletion_vectors", "bool", "tables created on first write get deletion vectors",
          False),
        S("auto_compact", "bool", "compact the tables this node commits between commits",
          node["auto_compact"]),
        S("compact_min_files", "int", "small files a bucket holds before it is compacted",
          node["compact_min_files"]),
        S("compact_interval", "float", "seconds between two compactions of a table, at least",
          node["compact_interval"]),
        S("random_marks_seconds", "float", "seconds a node keeps the lane marks of a stream "
          "with a random id after its last commit", node["random_marks_seconds"]),
        S("side_inputs", "list", "side input classes (module.Class) served to the receivers "
          "(repeatable)", [], flag="--side-input", metavar="module.Class"),
        S("side_input_timeout", "float", "seconds to wait at start for every side input's "
          "value", node["side_input_timeout"]),
        S("side_input_lease", "float", "seconds a side input leader's lease lasts unrenewed",
          node["side_input_lease"]),
        S("side_input_poll_interval", "float", "seconds between checks for new side-input "
          "versions", node["side_input_poll_interval"]),
        S("spark.master", "str", "local[*], a spark:// master URL or an sc:// Connect URL",
          spark["master"], metavar="URL"),
        S("spark.writer", "str", "direct: the node writes the files and Spark commits them; "
          "sql: Spark MERGEs every group", writer, choices=SPARK_WRITERS),
        S("spark.driver_memory", "str", "the embedded Spark driver's heap",
          spark["driver_memory"], flag="--driver-memory", metavar="SIZE"),
        S("spark.java_options", "str", "the embedded Spark driver's JVM options (unset: C1 "
          "and serial GC with the direct writer)", flag="--driver-java-options",
          metavar="OPTS"),
        S("spark.max_cores", "int", "spark:// masters: the cores this node's application takes "
          "at most", spark["max_cores"]),
        S("spark.executor_memory", "str", "spark:// masters: each executor's heap",
          spark["executor_memory"], metavar="SIZE"),
        S("spark.executor_wait", "float", "spark:// masters: seconds to wait at start for an "
          "executor", spark["executor_wait"]),
        S("log.format", "str", "text for people, json for collectors (one object a line)",
          "text", choices=("text", "json")),
        S("log.level", "str", "the level of deltaflow's own logs", "warning",
          choices=("debug", "info", "warning", "error")),
        S("log.spark_level", "str", "the level of Spark's JVM logs (log4j)", "ERROR",
          choices=("ALL", "DEBUG", "INFO", "WARN", "ERROR", "FATAL", "OFF"),
          flag="--spark-log-level"),
    )  # fmt: skip


SETTINGS: Final[tuple[Setting, ...]] = _settings()
BY_KEY: Final = {s.key: s for s in SETTINGS}
SECTIONS: Final = {s.key.split(".")[0] for s in SETTINGS if "." in s.key}
