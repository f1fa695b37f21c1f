"""Spark and Delta: the process's SparkSession, Delta jars, and the table engine.

Importing this package does not import PySpark; :func:`get_spark` does, with a clear
ImportError naming the extra to install.
"""

from .engine import SparkTableEngine
from .jars import ensure_jars
from .session import SparkConfig, get_spark

__all__ = ["SparkConfig", "SparkTableEngine", "ensure_jars", "get_spark"]
