"""deltaflow: stream records from Python into Delta Lake tables through a cluster of nodes.

Usage::

    async with deltaflow.connect(nodes) as client:
        await client.stream_data(rows, table="t", key="id")
"""

from .client import (
    Client,
    CommitPosition,
    Delete,
    StreamerOptions,
    StreamSummary,
    connect,
    stream_data,
)
from .columnar import DELETE_COLUMN, ArrowRows
from .errors import DataStreamerError, DeltaflowError, FailedItem

__all__ = [
    "DELETE_COLUMN",
    "ArrowRows",
    "Client",
    "CommitPosition",
    "DataStreamerError",
    "Delete",
    "DeltaflowError",
    "FailedItem",
    "StreamSummary",
    "StreamerOptions",
    "connect",
    "stream_data",
]

__version__ = "0.1.0"
