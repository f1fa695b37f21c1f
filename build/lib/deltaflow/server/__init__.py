"""The deltaflow node: :mod:`.node` (app and lifecycle), :mod:`.connection` (one client
WebSocket), :mod:`.dispatcher` (lanes, ordering, receivers, acks), :mod:`.topology`
(membership and partition map). Table commits live in :mod:`deltaflow.spark_integration`."""

from .node import Node, NodeConfig, NodeState, NodeStatistics, start_local_nodes

__all__ = ["Node", "NodeConfig", "NodeState", "NodeStatistics", "start_local_nodes"]
