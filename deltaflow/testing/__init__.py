"""Seams for fault injection and test receivers, shipped so users can test like we do.

- :class:`ConnectionDropper`: a ``connection_factory`` for :func:`deltaflow.connect` that cuts
  real connections after a number of batch frames, as a network failure would.
- :class:`Echo`, :class:`EchoStream`, :class:`FailOn`, :class:`AppendRows`, :class:`Validate`,
  :class:`Flaky`, :class:`Concurrency`, :class:`Gated`, :class:`Lookup`, :class:`RecordOrder`,
  :class:`TwoTables`, :class:`Unconstructible`: receivers to register on a node
  (``--receiver deltaflow.testing.Echo``) for smoke tests of a deployment.
- ``DELTAFLOW_FAULT_KILL_AFTER_COMMIT=N`` in a node's environment: the node SIGKILLs itself
  right after its N-th table commit, before acknowledging it (crash between commit and ack).
- :func:`at_fault_point`: run a function where a node in this process reaches a fault point,
  e.g. another writer's commit between a group's files being written and its commit.
- :class:`KillOnKey`: a ``key=`` function that SIGKILLs the process streaming (a Spark
  executor's Python worker, say) when it meets a given key, once: a client crash mid-stream.
- :class:`FileSideInput` and :class:`FailingSideInput`: side inputs (``--side-input
  deltaflow.testing.FileSideInput``); :class:`SideInputEcho` returns what a side input held for
  each item, and :func:`stamped_value`/:func:`check_stamped` make and check values whose
  tearing would show.
- :class:`NodeProcess`: ``deltaflow serve`` as a child process (start, SIGKILL, stop), and
  :func:`wait_for_members` until such nodes see each other.
- ``DELTAFLOW_FAULT_UNREACHABLE=HOST:PORT,...``: a node cut off from those peers, as by a
  network partition.
- ``DELTAFLOW_FAULT_UNREACHABLE_COMMITS=HOST:PORT,...``: only a node's commit calls to those
  peers go unanswered (a committer it cannot reach while the map still names it).
- :mod:`.certificates` (a CA issuing node and client certificates, for TLS), :mod:`.netns`
  (hosts as network namespaces on a bridge), :mod:`.object_store` (a real S3 server): import
  them from their modules, they need extra packages or root.

They live in :mod:`.connections`, :mod:`.receivers`, :mod:`.faults`, :mod:`.side_inputs` and
:mod:`.processes`; import them from here, the name they go by (``deltaflow.testing.Echo``).
"""

from __future__ import annotations

from types import FunctionType

from .connections import ConnectionDropper, RequestDropper
from .faults import KillOnKey, at_fault_point
from .processes import NodeProcess, free_port, wait_for_members
from .receivers import (
    AppendRows,
    Concurrency,
    Discard,
    Echo,
    EchoStream,
    FailOn,
    Flaky,
    Gated,
    Lookup,
    RecordOrder,
    TwoTables,
    Unconstructible,
    Validate,
)
from .side_inputs import (
    SIDE_INPUT_FILE_ENV,
    FailingSideInput,
    FileSideInput,
    SideInputEcho,
    check_stamped,
    stamped_value,
)

__all__ = [
    "SIDE_INPUT_FILE_ENV",
    "AppendRows",
    "Concurrency",
    "ConnectionDropper",
    "Discard",
    "Echo",
    "EchoStream",
    "FailOn",
    "FailingSideInput",
    "FileSideInput",
    "Flaky",
    "Gated",
    "KillOnKey",
    "Lookup",
    "NodeProcess",
    "RecordOrder",
    "RequestDropper",
    "SideInputEcho",
    "TwoTables",
    "Unconstructible",
    "Validate",
    "at_fault_point",
    "check_stamped",
    "free_port",
    "stamped_value",
    "wait_for_members",
]

# Every name's public home is this package: receivers and side inputs are named
# "deltaflow.testing.Echo" on the command line, in the registry and in error messages, and
# KillOnKey pickles (to Spark executors) under that name too.
for _name in __all__:
    _export = globals()[_name]
    if isinstance(_export, (type, FunctionType)):
        _export.__module__ = __name__
del _name, _export
