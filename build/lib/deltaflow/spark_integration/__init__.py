"""Delta tables: the table engine seam and its Spark and delta-rs engines, the process's
SparkSession and Delta jars; Spark as a source (``stream_dataframe``, ``foreach_batch``) and as
a reader (``read_table``, ``read_dead_letters``).

Importing this package does not import PySpark; :func:`get_spark` does, with a clear
ImportError naming the extra to install.
"""

from .dataframe import (
    DataFrameStreamError,
    DataFrameSummary,
    ForeachBatchWriter,
    PartitionFailure,
    foreach_batch,
    read_dead_letters,
    read_table,
    stream_dataframe,
)
from .deltars_engine import DeltaRsTableEngine
from .engine import TableEngine
from .jars import ensure_jars
from .session import SparkConfig, get_spark
from .spark_engine import SparkTableEngine
from .tables import BUCKET_COLUMN, TableSettings, create_table, read_table_settings

#: Engines a node can be started with (``NodeConfig.engine`` / ``deltaflow serve --engine``).
ENGINES: dict[str, type[TableEngine]] = {
    SparkTableEngine.name: SparkTableEngine,
    DeltaRsTableEngine.name: DeltaRsTableEngine,
}

__all__ = [
    "BUCKET_COLUMN",
    "ENGINES",
    "DataFrameStreamError",
    "DataFrameSummary",
    "DeltaRsTableEngine",
    "ForeachBatchWriter",
    "PartitionFailure",
    "SparkConfig",
    "SparkTableEngine",
    "TableEngine",
    "TableSettings",
    "create_table",
    "ensure_jars",
    "foreach_batch",
    "get_spark",
    "read_dead_letters",
    "read_table",
    "read_table_settings",
    "stream_dataframe",
]
