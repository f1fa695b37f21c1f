"""One SparkSession with Delta Lake per process.

``local[*]`` by default (embedded), a Spark master URL (``spark://...``, ``yarn``...) or a Spark
Connect URL (``sc://...``) when configured. Delta's jars come from the local cache filled by
:mod:`.jars` (fetched from Maven Central on first use).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import os
import socket
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from ..errors import UsageError
from ..storage.paths import Location, StorePath

__all__ = [
    "DEFAULT_MASTER",
    "DIRECT_WRITER_JAVA_OPTIONS",
    "LOCAL_FILE_SETTINGS",
    "SQL_SETTINGS",
    "SparkConfig",
    "connect_session",
    "get_spark",
    "require_spark",
    "session_for",
]

log = logging.getLogger(__name__)

DEFAULT_MASTER: Final = "local[*]"
#: A Spark Connect URL's port when it names none.
CONNECT_DEFAULT_PORT: Final = 15002
#: The driver JVM's options when nodes commit with the direct writer: the JVM then runs Delta's
#: commit code and little else, so the C1 compiler alone (a fraction of C2's compile work, which
#: competes with the node's Python for the CPU in the first minutes of a node's life) and the
#: serial collector (no concurrent GC threads competing with the node's Python) suit it. A JVM
#: that runs Spark jobs (the SQL writer, a MERGE) wants the defaults.
DIRECT_WRITER_JAVA_OPTIONS: Final = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: How the driver writes to ``file:`` paths (a local or mounted warehouse). Without Hadoop's
#: native library, its local file system starts a process for every ``chmod`` and, through
#: ``FileContext``, for every ``readlink`` of a rename: those processes took most of a Delta
#: commit's time (log entry and checksum file). With these, a commit starts one ``chmod`` per
#: file. Safe here because every deltaflow commit holds the table's commit atomicity
#: (``tables/atomicity.py``): the default ``HDFSLogStore`` does not make put-if-absent atomic across
#: processes on a local file system either.
LOCAL_FILE_SETTINGS: Final = {
    # Delta's log store over Hadoop's FileSystem (exists, then rename) instead of FileContext.
    "spark.delta.logStore.file.impl": "org.apache.spark.sql.delta.storage.LocalLogStore",
    # Delta writes each version's checksum file through Spark's checkpoint file manager.
    "spark.sql.streaming.checkpointFileManagerClass": (
        "org.apache.spark.sql.execution.streaming.checkpointing.FileSystemBasedCheckpointFileManager"
    ),
    # No ".crc" side file (and its chmod) for every file the driver writes.
    "spark.hadoop.fs.file.impl": "org.apache.hadoop.fs.RawLocalFileSystem",
}
#: Session-level SQL settings, for the embedded driver and every Spark Connect session alike.
SQL_SETTINGS: Final = {
    "spark.databricks.delta.snapshotPartitions": "2",
    # A MERGE source here is a staging Parquet file written once and never changed, so Delta
    # need not copy it before its two passes (saves a Spark job per commit).
    "spark.databricks.delta.merge.materializeSource": "none",
    # A group whose MERGE or INSERT changes no row (deletes of keys no file holds) must still
    # commit, with its lane marks, so that the batch sent again is skipped; Delta skips such
    # commits by default.
    "spark.databricks.delta.skipRecordingEmptyCommits": "false",
    "spark.sql.session.timeZone": "UTC",
    # Data files written by the nodes (pyarrow) and by delta-rs use the proleptic Gregorian
    # calendar, as Spark 3+ does, but carry no Spark version, so Spark refuses their dates
    # before 1582 and timestamps before 1900 unless told so.
    "spark.sql.parquet.datetimeRebaseModeInRead": "CORRECTED",
    "spark.sql.parquet.int96RebaseModeInRead": "CORRECTED",
    "spark.sql.parquet.datetimeRebaseModeInWrite": "CORRECTED",
    "spark.sql.parquet.int96RebaseModeInWrite": "CORRECTED",
}
_lock = threading.Lock()
_session: Any = None
_connect_sessions: dict[str, Any] = {}


def require_spark() -> Any:
    """Import pyspark 4, or fail with what to install (the session's settings name Spark 4
    classes: on Spark 3 every Delta commit would be far slower, not refused)."""
    try:
        import pyspark
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(
            "deltaflow's table engine needs PySpark and Delta: pip install 'deltaflow[spark]'"
        ) from exc
    major = pyspark.__version__.split(".")[0]
    if not major.isdigit() or int(major) < 4:
        raise ImportError(
            f"deltaflow's Spark session needs pyspark 4 (tested: 4.2.0 with delta-spark 4.4.0), "
            f"found pyspark {pyspark.__version__}: pip install 'deltaflow[spark]'"
        )
    return pyspark


@dataclass(frozen=True, slots=True, kw_only=True)
class SparkConfig:
    """How a node (or a test, or the demo) gets its SparkSession.

    Attributes:
        master: ``local[*]`` (default), a Spark master URL, or a Spark Connect ``sc://`` URL.
        app_name: the Spark application name. Default ``"deltaflow"``.
        driver_memory: JVM heap of the embedded driver. Default ``"2g"``.
        shuffle_partitions: ``spark.sql.shuffle.partitions``; small keeps MERGE fixed costs
            low on one machine. Default 4.
        java_options: JVM options of the embedded driver (``spark.driver.extraJavaOptions``),
            applied only by the call that starts the JVM. None (default): none, except that the
            Spark engine's direct writer picks :data:`DIRECT_WRITER_JAVA_OPTIONS`; ``""``: none.
        max_cores: on a standalone cluster (``spark://``), the cores this node's application
            takes at most (``spark.cores.max``), so that several nodes share the cluster instead
            of the first taking every core. Default 1.
        executor_memory: on a standalone cluster, each executor's heap. Default ``"1g"``.
        executor_wait: on a standalone cluster, seconds to wait at start for the first
            executor; a cluster with no room for one fails the start with an error saying so.
            Default 60.
        object_store: the session writes tables on S3: it gets S3A's jars and deltaflow's
            conditional-write log store (:mod:`.s3a`). Applied only by the call that starts the
            JVM. Default False.
        log_level: the level of Spark's own (log4j) logs. Default ``"ERROR"``.
        extra: any further Spark settings.
    """

    master: str = DEFAULT_MASTER
    app_name: str = "deltaflow"
    driver_memory: str = "2g"
    shuffle_partitions: int = 4
    java_options: str | None = None
    max_cores: int = 1
    executor_memory: str = "1g"
    executor_wait: float = 60.0
    object_store: bool = False
    log_level: str = "ERROR"
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.master:
            raise UsageError("SparkConfig.master must be set, e.g. 'local[*]'")
        if self.shuffle_partitions < 1:
            raise UsageError("SparkConfig.shuffle_partitions must be >= 1")
        if self.max_cores < 1 or not self.executor_wait > 0:
            raise UsageError("SparkConfig.max_cores must be >= 1 and executor_wait > 0")

    @property
    def connect(self) -> bool:
        """Whether the master is a Spark Connect server (``sc://``): no driver JVM here."""
        return self.master.startswith("sc://")

    @property
    def standalone(self) -> bool:
        """Whether the master is a Spark standalone cluster (``spark://``)."""
        return self.master.startswith("spark://")


def get_spark(config: SparkConfig | None = None) -> Any:
    """The process's SparkSession with Delta, created on first call (blocking, seconds).

    One classic session per process (its driver JVM): later calls for a cluster or ``local``
    master return it whatever ``config`` says. A Spark Connect URL (``sc://``) gets its own
    session per URL, beside the classic one: a Connect session is a client, not a driver.
    """
    global _session
    config = config or SparkConfig()
    if config.connect:
        with _lock:
            if config.master not in _connect_sessions:
                session = _connect_sessions[config.master] = connect_session(config)
                # Registered after the client's own exit handler, so it runs before it.
                atexit.register(_close_channel, session)
            return _connect_sessions[config.master]
    with _lock:
        if _session is not None:
            return _session
        require_spark()
        from pyspark.sql import SparkSession

        from .jars import ensure_jars

        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
        builder = SparkSession.builder.appName(config.app_name).master(config.master)
        settings: dict[str, str] = {
            "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
            "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
            "spark.ui.enabled": "false",
            "spark.ui.showConsoleProgress": "false",
            **_session_settings(config),
            "spark.default.parallelism": str(config.shuffle_partitions),
            **LOCAL_FILE_SETTINGS,
            "spark.jars": ",".join(str(p) for p in ensure_jars()),
            "spark.driver.memory": config.driver_memory,
        }
        if config.object_store:
            from .s3a import ensure_object_store_jars, object_store_settings

            settings.update(object_store_settings())
            jars = [*ensure_jars(), *ensure_object_store_jars()]
            settings["spark.jars"] = ",".join(str(p) for p in jars)
        if config.master.startswith("local"):
            # Keep the embedded driver on loopback: no traffic leaves the machine.
            os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
            settings["spark.driver.host"] = "127.0.0.1"
            settings["spark.driver.bindAddress"] = "127.0.0.1"
            # Adaptive query execution re-plans between stages to even out a cluster's
            # skew; on one machine it only adds planning to every commit's jobs.
            settings["spark.sql.adaptive.enabled"] = "false"
        if config.standalone:
            # A bounded share: one application per node, each of its executors as large
            # as its cores, so several nodes fit on one cluster.
            settings["spark.cores.max"] = str(config.max_cores)
            settings["spark.executor.cores"] = str(config.max_cores)
            settings["spark.executor.memory"] = config.executor_memory
        # Spark's own logs at the level asked from the JVM's first line (its default profile
        # says INFO and WARN lines before setLogLevel can run).
        java_options = f"{config.java_options or ''} -Dlog4j2.configurationFile="
        java_options += _log4j_file(config.log_level).as_uri()
        settings["spark.driver.extraJavaOptions"] = java_options.strip()
        settings.update(config.extra)
        for k, v in settings.items():
            builder = builder.config(k, v)
        log.info("starting Spark (%s)", config.master)
        with _jvm_stderr_filtered():
            session = builder.getOrCreate()
        session.sparkContext.setLogLevel(config.log_level)
        if config.standalone:
            _wait_for_an_executor(session, config)
        _session = session
        return session


def session_for(warehouse: Location, config: SparkConfig) -> Any:
    """Blocking: the process's classic session (:func:`get_spark`), able to write the tables
    under ``warehouse``: on an object store, with S3A and deltaflow's log store
    (:mod:`.s3a`), and the bucket's settings."""
    if not isinstance(warehouse, StorePath):
        return get_spark(config)
    from .s3a import configure_bucket

    session = get_spark(dataclasses.replace(config, object_store=True))
    configure_bucket(session, str(warehouse), warehouse.storage_options)
    return session


def connect_session(config: SparkConfig) -> Any:
    """Blocking: a new session on the Spark Connect server ``config.master`` (``sc://``), with
    deltaflow's SQL settings; its SQL conf is its own (the server keeps one per session).

    Made by the Connect client's own builder: pyspark's generic one would mark the whole
    process as Connect-only (``SPARK_CONNECT_MODE_ENABLED``), and a classic session beside it
    would then break.

    Raises:
        UsageError: the server cannot be reached (says where and what to check).
    """
    require_spark()
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    _check_listening(config.master)
    builder = ConnectSession.builder.remote(config.master)
    for name, value in {**_session_settings(config), **config.extra}.items():
        builder = builder.config(name, value)
    try:
        session = builder.create()
        _bound_retries(session.client)
        session.sql("SELECT 1").collect()  # the client connects lazily: fail here, not later
    except Exception as exc:
        raise UsageError(
            f"cannot reach the Spark Connect server {config.master}: {type(exc).__name__}: "
            f"{str(exc)[:300]}. Is it running (deltaflow spark-connect) and listening there?"
        ) from exc
    return session


def _bound_retries(client: Any) -> None:
    """Retry a failed call for seconds, not the Connect client's default ten minutes: a commit
    retried that long would hold its table, and a process whose server is gone would take
    that long to exit (the client's exit handler calls the server). A call that still fails
    fails its commit, which deltaflow retries like any other."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    bounded = DefaultPolicy(max_retries=5, initial_backoff=50, max_backoff=4000)
    policies = client.get_retry_policies()
    client.set_retry_policies([bounded if isinstance(p, DefaultPolicy) else p for p in policies])


def _close_channel(session: Any) -> None:
    """At exit: close a Connect session's channel without calling the server (the client's own
    exit handler would, and wait on a server that may be gone)."""
    with contextlib.suppress(Exception):
        session.client.close()


def _check_listening(url: str, timeout: float = 10.0) -> None:
    """Fail at once when nothing listens at a Connect URL: the Connect client would retry
    its first call for minutes."""
    address = urllib.parse.urlsplit(url.split(";")[0].replace("sc://", "http://", 1))
    host, port = address.hostname or "localhost", address.port or CONNECT_DEFAULT_PORT
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        raise UsageError(
            f"cannot reach the Spark Connect server {url}: nothing accepts connections at "
            f"{host}:{port} ({exc}). Start one (deltaflow spark-connect) or fix the URL"
        ) from exc


#: What the JVM prints to stderr at every start and nobody can act on: Spark's launcher always
#: adds the incubating vector module, and the JVM then warns that it uses it.
_JVM_NOISE: Final = (b"WARNING: Using incubator modules",)


@contextlib.contextmanager
def _jvm_stderr_filtered() -> Iterator[None]:
    """Start the driver JVM with its stderr through a pipe that drops :data:`_JVM_NOISE` and
    passes everything else on (a daemon thread, for the JVM's life); this process's own stderr
    is back as it was on exit."""
    try:
        original = os.dup(2)
    except OSError:  # no stderr to filter
        yield
        return
    read_end, write_end = os.pipe()

    def forward() -> None:
        with os.fdopen(read_end, "rb") as pipe, os.fdopen(original, "wb", buffering=0) as out:
            for line in pipe:
                if not line.startswith(_JVM_NOISE):
                    out.write(line)

    sys.stderr.flush()
    os.dup2(write_end, 2)
    os.close(write_end)
    threading.Thread(target=forward, name="deltaflow-jvm-stderr", daemon=True).start()
    restore = os.dup(original)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(restore, 2)
        os.close(restore)


_SHELL_LOGGERS: Final = {
    "repl": "org.apache.spark.repl.Main",
    "submit": "org.apache.spark.deploy.SparkSubmit",
    "gateway": "org.apache.spark.api.python.PythonGatewayServer",
}


def _log4j_file(level: str) -> Path:
    """A log4j2 configuration sending Spark's logs at ``level`` and above to stderr: one file
    per level in the temporary directory, the same text for every process (replaced whole)."""
    path = Path(tempfile.gettempdir()) / f"deltaflow-log4j2-{level.lower()}.properties"
    # A level of their own for the classes that start a PySpark driver keeps Spark from
    # announcing the shell's level ("Setting default log level to WARN").
    shell = "".join(
        f"logger.{name}.name = {cls}\nlogger.{name}.level = {level}\n"
        for name, cls in _SHELL_LOGGERS.items()
    )
    text = (
        f"rootLogger.level = {level}\n" + shell + "rootLogger.appenderRef.stderr.ref = stderr\n"
        "appender.console.type = Console\n"
        "appender.console.name = stderr\n"
        "appender.console.target = SYSTEM_ERR\n"
        "appender.console.layout.type = PatternLayout\n"
        "appender.console.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} %p %c{1}: %m%n%ex\n"
    )
    if not (path.exists() and path.read_text() == text):
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(text)
        os.replace(partial, path)
    return path


def _session_settings(config: SparkConfig) -> dict[str, str]:
    """The SQL settings every deltaflow session gets, classic or Connect."""
    return {**SQL_SETTINGS, "spark.sql.shuffle.partitions": str(config.shuffle_partitions)}


def executor_count(session: Any) -> int:
    """The executors the session's application holds now (the driver not counted)."""
    infos = session.sparkContext._jsc.sc().statusTracker().getExecutorInfos()
    return max(len(infos) - 1, 0)


def _wait_for_an_executor(session: Any, config: SparkConfig) -> None:
    """Blocking: wait until the cluster gives the application an executor; else stop the
    application and fail, saying why (a job would otherwise wait for one forever)."""
    deadline = time.monotonic() + config.executor_wait
    while executor_count(session) < 1:
        if time.monotonic() > deadline:
            session.stop()
            raise UsageError(
                f"the Spark cluster {config.master} gave this node no executor within "
                f"{config.executor_wait:g} s: no worker has {config.max_cores} free core(s) and "
                f"{config.executor_memory} free memory for it (other applications, such as "
                "other nodes, may hold them). Add workers, or lower --spark-max-cores / "
                "--spark-executor-memory"
            )
        time.sleep(0.2)
