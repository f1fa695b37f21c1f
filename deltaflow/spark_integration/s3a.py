"""Spark's Delta on an S3 warehouse: Hadoop's S3A connector, and a log store whose commits are
safe with writers on many hosts.

Released Delta (4.4) commits to S3 through ``S3SingleDriverLogStore``, whose put-if-absent of
a commit file holds only within one JVM: two drivers racing for one version both succeed and
one commit is lost (docs/object-storage.md). deltaflow ships ``ConditionalS3LogStore`` (Java
source beside this module), which creates each commit file by a conditional PUT
(``If-None-Match: *``, S3A's conditional create since Hadoop 3.4.2) and turns a refused create
into the ``FileAlreadyExistsException`` Delta retries on. ``deltaflow jars --object-store``
fetches S3A's jars and builds the log store's jar with ``javac`` (a JDK is needed once).

A session started with :attr:`.SparkConfig.object_store` has the jars and names the log store
for ``s3://`` and ``s3a://``; :func:`configure_bucket` gives it a bucket's endpoint and
credentials (per-bucket S3A settings, so several stores can share one session);
:func:`.session_for` does both for a warehouse.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from ..errors import UsageError
from .jars import ensure_artifacts, ensure_jars, jars_dir, pyspark_jars

__all__ = [
    "LOG_STORE_CLASS",
    "configure_bucket",
    "ensure_object_store_jars",
    "object_store_settings",
]

#: The log store class, for ``spark.delta.logStore.<scheme>.impl``.
LOG_STORE_CLASS: Final = "io.deltaflow.storage.ConditionalS3LogStore"
_SOURCE: Final = Path(__file__).with_name("logstore") / "ConditionalS3LogStore.java"

#: What S3A needs beside the Hadoop client pyspark ships, by that Hadoop's version:
#: (the AWS SDK bundle, the S3 analytics accelerator), as hadoop-aws's own pom names them.
S3A_DEPENDENCIES: Final = {"3.5.0": ("2.35.4", "1.3.1")}


def hadoop_version() -> str:
    """The version of the Hadoop client jars the installed pyspark ships."""
    shipped = pyspark_jars()
    for jar in shipped.glob("hadoop-client-api-*.jar") if shipped else []:
        return jar.stem.removeprefix("hadoop-client-api-")
    raise UsageError("the installed pyspark ships no Hadoop client: pip install 'deltaflow[spark]'")


def s3a_artifacts() -> list[tuple[str, str, str]]:
    """(group, artifact, version) of hadoop-aws and what it needs, for pyspark's Hadoop."""
    hadoop = hadoop_version()
    if hadoop not in S3A_DEPENDENCIES:
        raise UsageError(
            f"deltaflow knows S3A's dependencies for Hadoop {sorted(S3A_DEPENDENCIES)}, not "
            f"{hadoop} (the installed pyspark's); use pyspark 4.2"
        )
    sdk, accelerator = S3A_DEPENDENCIES[hadoop]
    return [
        ("org.apache.hadoop", "hadoop-aws", hadoop),
        ("software.amazon.awssdk", "bundle", sdk),
        ("software.amazon.s3.analyticsaccelerator", "analyticsaccelerator-s3", accelerator),
    ]


def ensure_object_store_jars(directory: Path | None = None) -> list[Path]:
    """S3A's jars and the log store's, fetched and built into the cache if missing.

    Raises:
        RuntimeError: a jar could not be fetched, or the log store not built (no ``javac``).
    """
    directory = directory or jars_dir()
    s3a = ensure_artifacts(s3a_artifacts(), directory)
    return [*s3a, _log_store_jar(directory, s3a)]


def _log_store_jar(directory: Path, s3a: list[Path]) -> Path:
    """The log store's jar, compiled from its source against the jars it runs with; named by
    a digest of them all, so a changed source or version builds anew."""
    shipped = pyspark_jars()
    assert shipped is not None  # hadoop_version() found it
    classpath = [
        *sorted(shipped.glob("hadoop-client-api-*.jar")),
        s3a[0],
        *[p for p in ensure_jars(directory) if "delta-storage" in p.name],
    ]
    source = _SOURCE.read_bytes()
    digest = hashlib.sha256(source + "|".join(p.name for p in classpath).encode()).hexdigest()
    jar = directory / f"deltaflow-logstore-{digest[:12]}.jar"
    if jar.exists():
        return jar
    javac = shutil.which("javac") or (
        os.path.join(os.environ["JAVA_HOME"], "bin", "javac") if "JAVA_HOME" in os.environ else None
    )
    if javac is None or not os.path.exists(javac):
        raise RuntimeError(
            "building deltaflow's S3 log store needs a JDK (javac on PATH or in JAVA_HOME), once"
        )
    with tempfile.TemporaryDirectory() as build:
        done = subprocess.run(
            [javac, "--release", "17", "-d", build, "-cp", os.pathsep.join(map(str, classpath)),
             str(_SOURCE)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"javac could not build the S3 log store: {done.stderr[-2000:]}")
        part = jar.with_suffix(".part")
        with zipfile.ZipFile(part, "w", zipfile.ZIP_DEFLATED) as out:
            for compiled in sorted(Path(build).rglob("*.class")):
                out.write(compiled, compiled.relative_to(build).as_posix())
        part.replace(jar)
    return jar


def object_store_settings() -> dict[str, str]:
    """The Spark settings, at session start, of a session that writes Delta tables on S3."""
    settings = {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
        "spark.hadoop.fs.s3a.create.conditional.enabled": "true",
        # Uploads buffered on the heap: the disk buffer asks for Hadoop's checksummed local
        # file system, which the fast local settings replace (LOCAL_FILE_SETTINGS).
        "spark.hadoop.fs.s3a.fast.upload.buffer": "array",
    }
    for scheme in ("s3", "s3a"):
        settings[f"spark.delta.logStore.{scheme}.impl"] = LOG_STORE_CLASS
    return settings


#: delta-rs storage option (and environment variable) -> per-bucket S3A setting.
_S3A_OPTIONS: Final = {
    "AWS_ACCESS_KEY_ID": "access.key",
    "AWS_SECRET_ACCESS_KEY": "secret.key",
    "AWS_SESSION_TOKEN": "session.token",
    "AWS_REGION": "endpoint.region",
}


def configure_bucket(session: Any, uri: str, options: Mapping[str, str]) -> None:
    """Give ``session``'s S3A the endpoint and credentials of the bucket of ``uri``, from the
    store's ``options`` (delta-rs's names) and else the ``AWS_*`` environment variables."""
    bucket = urlsplit(uri).netloc
    given = {k.upper(): v for k, v in options.items()}

    def value(name: str) -> str | None:
        return given.get(name) or os.environ.get(name)

    settings: dict[str, str] = {}
    for name, key in _S3A_OPTIONS.items():
        if (found := value(name)) is not None:
            settings[key] = found
    if value("AWS_SESSION_TOKEN"):
        settings["aws.credentials.provider"] = (
            "org.apache.hadoop.fs.s3a.TemporaryAWSCredentialsProvider"
        )
    endpoint = value("AWS_ENDPOINT_URL")
    if endpoint:
        settings["endpoint"] = endpoint
        # An S3-compatible server at an address: bucket in the path, not the host name.
        virtual = (value("AWS_VIRTUAL_HOSTED_STYLE_REQUEST") or "").lower() == "true"
        settings["path.style.access"] = str(not virtual).lower()
        settings["connection.ssl.enabled"] = str(endpoint.startswith("https")).lower()
    conf = session.sparkContext._jsc.hadoopConfiguration()
    for key, setting in settings.items():
        conf.set(f"fs.s3a.bucket.{bucket}.{key}", setting)
