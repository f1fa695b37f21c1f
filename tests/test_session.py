"""The Spark session's requirements: pyspark 4, and the Delta jars that match it."""

from __future__ import annotations

from importlib import metadata

import pyspark
import pytest

from deltaflow.spark_integration import jars
from deltaflow.spark_integration.session import require_spark


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
