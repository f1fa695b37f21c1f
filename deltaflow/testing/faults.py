"""Faults injected inside a process: a function run where a node reaches a fault point, and a
``key=`` function that kills the process streaming.

``DELTAFLOW_FAULT_KILL_AFTER_COMMIT=N`` (and ``DELTAFLOW_FAULT_KILL_<POINT>``) in a node's
environment makes the node SIGKILL itself at a point instead; ``DELTAFLOW_FAULT_STOP_<POINT>=N``
SIGSTOP itself, once; ``DELTAFLOW_FAULT_TICK_<POINT>=SECONDS`` wait there for the next tick of
the wall clock, which node processes share (:mod:`deltaflow._faults`).
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .. import _faults

__all__ = ["KillOnKey", "at_fault_point"]


@contextlib.contextmanager
def at_fault_point(name: str, action: Callable[[], None]) -> Iterator[None]:
    """While in the block, run ``action`` (on the reaching thread, blocking it) whenever a
    node of this process reaches fault point ``name``. Points: ``before_listing`` (a group
    is about to list the table's live files it may touch; the lane marks are read),
    ``before_commit`` (a group's data files are written, its commit not yet made; the Spark
    engine's direct writer and the delta-rs engine's copy-on-write and merge-on-read),
    ``before_write`` (a group's marks were read for the last time, the engine is about to
    write it), ``after_commit`` (the commit landed, its batches not yet acknowledged), ``taken`` (a
    group was taken off the table's queue, not yet prepared), ``prepared``
    (a group was prepared outside the table's lock and is about to wait for it),
    ``applying`` (a batch of a lane was decoded, its receiver not yet run; on the node's event
    loop), ``creating`` (a writer found no table and is about to create it, the table held),
    ``converting`` (a write's rows are about to be checked and converted for the queue) and
    ``checkpointing`` (a checkpoint a commit made due is about to be written, on its own
    thread, the table's lock released) and ``side_input_publish`` (a side input's leader read
    its lease, valid, and wrote the new version's file; it is about to swap ``state``)."""
    _faults.set_action(name, action)
    try:
        yield
    finally:
        _faults.set_action(name, None)


class KillOnKey:
    """A ``key=`` function that SIGKILLs its own process when it meets ``value`` in ``column``.

    It kills only once: it first creates ``marker`` (a file path), and never kills while the
    marker exists. Pass it as ``key=`` to :func:`deltaflow.stream_data` or to the Spark helpers
    (it pickles, so it travels to Spark executors) to crash a client in the middle of a
    stream, after the items before ``value`` were pulled and some of their batches acked, as an
    executor lost mid-task would. Otherwise it returns ``item[column]``.
    """

    def __init__(self, column: str, value: Any, marker: str | os.PathLike[str]) -> None:
        self.column = column
        self.value = value
        self.marker = str(marker)

    def __repr__(self) -> str:
        return f"<KillOnKey {self.column}={self.value!r} marker={self.marker}>"

    def __call__(self, item: Any) -> Any:
        key = item[self.column]
        if key == self.value:
            try:
                Path(self.marker).touch(exist_ok=False)
            except FileExistsError:
                return key
            os.kill(os.getpid(), signal.SIGKILL)
        return key
