"""deltaflow: stream records from Python into Delta Lake tables through a cluster of nodes.

Usage::

    async with deltaflow.connect(nodes) as client:
        await client.stream_data(rows, table="t", key="id")

The names below are imported on first use, so a node process (``deltaflow.server``) does not
import the client.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import (
        Changelog,
        Client,
        CommitPosition,
        Delete,
        StreamerOptions,
        StreamSummary,
        connect,
        set_null,
        stream_data,
    )
    from .columnar import DELETE_COLUMN, ArrowRows
    from .engines import create_table
    from .errors import DataStreamerError, DeltaflowError, FailedItem
    from .security import ClientTls

_HOMES = {
    "Changelog": "client",
    "Client": "client",
    "CommitPosition": "client",
    "Delete": "client",
    "StreamerOptions": "client",
    "StreamSummary": "client",
    "connect": "client",
    "set_null": "client",
    "stream_data": "client",
    "DELETE_COLUMN": "columnar",
    "ArrowRows": "columnar",
    "create_table": "engines",
    "DataStreamerError": "errors",
    "DeltaflowError": "errors",
    "FailedItem": "errors",
    "ClientTls": "security",
}

__all__ = [
    "DELETE_COLUMN",
    "ArrowRows",
    "Changelog",
    "Client",
    "ClientTls",
    "CommitPosition",
    "DataStreamerError",
    "Delete",
    "DeltaflowError",
    "FailedItem",
    "StreamSummary",
    "StreamerOptions",
    "connect",
    "create_table",
    "set_null",
    "stream_data",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
