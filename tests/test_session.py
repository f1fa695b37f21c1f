"""The Spark session's requirements: pyspark 4, the Delta jars that match it, and a Spark
Connect server that answers."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pyspark
import pytest

from deltaflow.spark_integration import jars
from deltaflow.spark_integration.session import require_spark
from deltaflow.testing import NodeProcess, free_port


def test_a_pyspark_3_is_refused_naming_the_versions_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pyspark, "__version__", "3.5.9")
    with pytest.raises(ImportError, match=r"needs pyspark 4 .*found pyspark 3\.5\.9"):
        require_spark()


@pytest.mark.parametrize(
    ("delta", "spark", "scala", "artifact"),
    [
        ("4.4.0", "4.2.0", "2.13", "delta-spark_4.2_2.13"),  # one jar per Spark minor
        ("4.1.0", "4.0.1", "2.13", "delta-spark_4.0_2.13"),
        ("4.0.0", "4.0.0", "2.13", "delta-spark_2.13"),  # before 4.1: per Scala version
        ("3.3.3", "3.5.9", "2.12", "delta-spark_2.12"),
    ],
)
def test_the_delta_jars_follow_the_installed_delta_and_spark(
    monkeypatch: pytest.MonkeyPatch, delta: str, spark: str, scala: str, artifact: str
) -> None:
    versions = {"delta-spark": delta, "pyspark": spark}
    monkeypatch.setattr(jars.metadata, "version", versions.__getitem__)
    monkeypatch.setattr(jars, "scala_binary", lambda: scala)
    assert jars.delta_artifacts() == [
        ("io.delta", artifact, delta),
        ("io.delta", "delta-storage", delta),
    ]


def test_the_scala_version_is_read_from_the_installed_pyspark() -> None:
    expected = "2.13" if metadata.version("pyspark").startswith("4.") else "2.12"
    assert jars.scala_binary() == expected


async def test_a_node_on_a_connect_url_where_nothing_listens_fails_at_once(
    tmp_path: Path,
) -> None:
    """The Connect client would retry its first call for minutes; the node's start says
    where it looked instead."""
    port = free_port()
    node = NodeProcess("n1", tmp_path / "w", spark_master=f"sc://127.0.0.1:{port}",
                       extra=["--engine", "spark"])  # fmt: skip
    with pytest.raises(RuntimeError, match=rf"cannot reach the Spark Connect server .*:{port}"):
        await node.start(timeout=60)
    await node.stop()
