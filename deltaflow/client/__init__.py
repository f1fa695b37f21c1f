"""The deltaflow client: connect, stream, get results back.

Stages, one module each: :mod:`.client` (facade), :mod:`.stream` (one stream's pump),
:mod:`.accumulator` (per-partition buffers), :mod:`.sender` (window and retries),
:mod:`.connection` (one WebSocket per node), :mod:`.results` (result dispatch),
:mod:`.sources` (source adapters), :mod:`.sync` (blocking facade), :mod:`.latency` (ack
latency).
"""

from .accumulator import Batch, BatchCreator, SizeBatchCreator
from .client import Client, ClientState, ClientStatistics, connect
from .latency import AckLatency
from .options import StreamerOptions
from .sender import NodeStatistics
from .stream import TABLE_RECEIVER, CommitPosition, Delete, StreamStatistics, StreamSummary
from .sync import stream_data

__all__ = [
    "TABLE_RECEIVER",
    "AckLatency",
    "Batch",
    "BatchCreator",
    "Client",
    "ClientState",
    "ClientStatistics",
    "CommitPosition",
    "Delete",
    "NodeStatistics",
    "SizeBatchCreator",
    "StreamStatistics",
    "StreamSummary",
    "StreamerOptions",
    "connect",
    "stream_data",
]
