"""An embedded cluster: several nodes in one process (the demo, the benchmarks, the tests)."""

from __future__ import annotations

import asyncio
import dataclasses

from .node import Node
from .node_config import NodeConfig

__all__ = ["start_local_nodes"]


async def start_local_nodes(count: int, config: NodeConfig) -> list[Node]:
    """Start ``count`` nodes in this process, ``node-1`` to ``node-<count>``, each with
    ``config`` (its ``node_id`` and ``peers`` replaced), and return once each sees all the
    others: the embedded cluster of the demo, the benchmarks and the tests."""
    nodes: list[Node] = []
    try:
        for i in range(count):
            node = Node(
                dataclasses.replace(
                    config, node_id=f"node-{i + 1}", peers=[n.address for n in nodes]
                )
            )
            await node.start()
            nodes.append(node)
        await asyncio.gather(*(n.wait_for_members(count) for n in nodes))
    except BaseException:
        for node in reversed(nodes):
            await node.stop()
        raise
    return nodes
