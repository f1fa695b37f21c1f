"""The deltaflow node: :mod:`.node` (app and lifecycle), :mod:`.connection` (one client
WebSocket), :mod:`.dispatcher` (receivers, acks) over :mod:`.streams` (who owns which stream),
:mod:`.lanes` (ordering) and
:mod:`.frames` (frames in and out), :mod:`.side_inputs`, :mod:`.topology` (membership and
partition map), :mod:`.statistics` and :mod:`.metrics`. Table commits live in
:mod:`deltaflow.tables` and the engine that makes them, in :mod:`deltaflow.engines`."""

from .local_cluster import start_local_nodes
from .node import Node, NodeConfig, NodeState
from .statistics import NodeStatistics

__all__ = ["Node", "NodeConfig", "NodeState", "NodeStatistics", "start_local_nodes"]
