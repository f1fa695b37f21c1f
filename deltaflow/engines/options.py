"""Which engine a node runs, and its settings: one typed value, :data:`EngineOptions`.

:class:`DeltaRsOptions` (the ``deltalake`` package, no JVM) or :class:`SparkOptions` (Delta
through PySpark: its session and its writer); :func:`engine_options` turns an engine's name
into its default options. This module is where the engine names and the Spark engine's writers
are listed once. It imports neither an engine nor PySpark (:mod:`deltaflow.spark_integration.
session` imports PySpark only when a session is made), so a node's configuration can hold
options without loading either.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Final, TypeAlias

from ..errors import UsageError
from ..spark_integration.session import SparkConfig

__all__ = [
    "DEFAULT_ENGINE",
    "DELTA_RS",
    "ENGINE_NAMES",
    "SPARK",
    "SPARK_WRITERS",
    "DeltaRsOptions",
    "EngineOptions",
    "SparkOptions",
    "check_engine",
    "engine_options",
]

SPARK: Final = "spark"
DELTA_RS: Final = "delta-rs"
#: Every engine a node can run (``deltaflow serve --engine``) or create a table with.
ENGINE_NAMES: Final = (SPARK, DELTA_RS)
#: A node's engine unless told otherwise (``deltaflow table create`` defaults to delta-rs:
#: creating a table needs no JVM).
DEFAULT_ENGINE: Final = SPARK
#: How the Spark engine can apply a group, its default first (see :mod:`.spark`): ``direct``
#: (the node writes the files and commits them through Spark's Delta) or ``sql`` (a Spark
#: MERGE or INSERT per group).
SPARK_WRITERS: Final = ("direct", "sql")


def check_engine(name: str) -> str:
    """``name`` if it names an engine.

    Raises:
        UsageError: it does not.
    """
    if name not in ENGINE_NAMES:
        raise UsageError(f"engine must be one of {list(ENGINE_NAMES)}, got {name!r}")
    return name


@dataclass(frozen=True, slots=True, kw_only=True)
class DeltaRsOptions:
    """The delta-rs engine (``deltalake``, no JVM); it has no settings of its own."""

    name: ClassVar[str] = DELTA_RS


@dataclass(frozen=True, slots=True, kw_only=True)
class SparkOptions:
    """The Spark engine and its settings.

    Attributes:
        config: how the node gets its SparkSession. Default :class:`SparkConfig` ``()``
            (``local[*]``).
        writer: how the engine applies a group: ``"direct"`` (default; the node writes the
            data files and commits them through Spark's Delta transaction, no Spark job) or
            ``"sql"`` (a Spark MERGE or INSERT per group). See docs/tables.md.

    Raises:
        UsageError: ``writer`` is not one of :data:`SPARK_WRITERS`.
    """

    name: ClassVar[str] = SPARK

    config: SparkConfig = field(default_factory=SparkConfig)
    writer: str = SPARK_WRITERS[0]

    def __post_init__(self) -> None:
        if self.writer not in SPARK_WRITERS:
            raise UsageError(
                f"the spark engine's writer must be one of {', '.join(SPARK_WRITERS)}, "
                f"got {self.writer!r}"
            )


#: A node's engine and its settings.
EngineOptions: TypeAlias = DeltaRsOptions | SparkOptions


def engine_options(value: str | EngineOptions) -> EngineOptions:
    """``value`` if it is options already, else the default options of the engine it names.

    Raises:
        UsageError: ``value`` names no engine.
    """
    if isinstance(value, DeltaRsOptions | SparkOptions):
        return value
    return SparkOptions() if check_engine(value) == SPARK else DeltaRsOptions()
