"""Delta tables: the table engine seam and its Spark and delta-rs engines, the process's
SparkSession and Delta jars.

Importing this package does not import PySpark; :func:`get_spark` does, with a clear
ImportError naming the extra to install.
"""

from .deltars_engine import DeltaRsTableEngine
from .engine import TableEngine
from .jars import ensure_jars
from .session import SparkConfig, get_spark
from .spark_engine import SparkTableEngine

#: Engines a node can be started with (``NodeConfig.engine`` / ``deltaflow serve --engine``).
ENGINES: dict[str, type[TableEngine]] = {
    SparkTableEngine.name: SparkTableEngine,
    DeltaRsTableEngine.name: DeltaRsTableEngine,
}

__all__ = [
    "ENGINES",
    "DeltaRsTableEngine",
    "SparkConfig",
    "SparkTableEngine",
    "TableEngine",
    "ensure_jars",
    "get_spark",
]
