"""What a client needs from Spark, and the session the Spark engine uses: the process's
SparkSession and Delta jars, Spark as a source (``stream_dataframe``, ``foreach_batch``) and
as a reader (``read_table``, ``read_dead_letters``). The Spark table engine itself is
:mod:`deltaflow.engines.spark`; nothing here imports it.

Names are imported on first use, so a node that imports the session does not import the
client's DataFrame source, and importing this package does not import PySpark:
:func:`get_spark` does, with a clear ImportError naming the extra to install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .dataframe import (
        DataFrameStreamError,
        DataFrameSummary,
        PartitionFailure,
        stream_dataframe,
    )
    from .jars import ensure_jars
    from .readers import read_dead_letters, read_table
    from .session import SparkConfig, get_spark
    from .streaming import ForeachBatchWriter, foreach_batch

_HOMES = {
    "DataFrameStreamError": "dataframe",
    "DataFrameSummary": "dataframe",
    "PartitionFailure": "dataframe",
    "stream_dataframe": "dataframe",
    "ForeachBatchWriter": "streaming",
    "foreach_batch": "streaming",
    "read_dead_letters": "readers",
    "read_table": "readers",
    "ensure_jars": "jars",
    "SparkConfig": "session",
    "get_spark": "session",
}

__all__ = [
    "DataFrameStreamError",
    "DataFrameSummary",
    "ForeachBatchWriter",
    "PartitionFailure",
    "SparkConfig",
    "ensure_jars",
    "foreach_batch",
    "get_spark",
    "read_dead_letters",
    "read_table",
    "stream_dataframe",
]


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
