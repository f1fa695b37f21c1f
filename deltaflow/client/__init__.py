"""The deltaflow client: connect, stream, get results back.

Stages, one module each: :mod:`.client` (facade), :mod:`.router` (partition map and
connections), :mod:`.stream` (one stream's pump), :mod:`.admission` (keying and packing items),
:mod:`.accumulator` (per-partition buffers), :mod:`.sender` (window and retries),
:mod:`.dead_letters` (the fallback policy), :mod:`.ledger` (items that did not land),
:mod:`.connection` (one WebSocket per node), :mod:`.results` (result dispatch),
:mod:`.sources` (source adapters), :mod:`.changelog` (change events as rows), :mod:`.sync`
(blocking facade), :mod:`.latency` (ack latency), :mod:`.stream_types` (what a stream takes
and gives back).
"""

from .accumulator import Batch, BatchCreator, SizeBatchCreator
from .changelog import Changelog
from .client import Client, ClientState, ClientStatistics, connect
from .latency import AckLatency
from .ledger import CommitPosition
from .options import StreamerOptions
from .sender import NodeStatistics
from .stream_types import TABLE_RECEIVER, Delete, StreamStatistics, StreamSummary, set_null
from .sync import stream_data

__all__ = [
    "TABLE_RECEIVER",
    "AckLatency",
    "Batch",
    "BatchCreator",
    "Changelog",
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
    "set_null",
    "stream_data",
]
