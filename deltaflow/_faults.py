"""Fault points for crash and race tests (see :mod:`deltaflow.testing`). Inert unless
configured.

``DELTAFLOW_FAULT_KILL_AFTER_COMMIT=N`` makes a node process SIGKILL itself right after its
N-th table commit lands and before the batches in it are acknowledged: the "crash between
commit and ack" that exactly-once must survive.

In-process, :func:`deltaflow.testing.at_fault_point` runs a function at a point instead, on the
thread that reaches it: ``before_commit`` is reached once a group's data files are written
and before the commit that adds them (another writer committing there is the race the commit
must detect); ``before_listing`` before a group lists the live files it may touch, after the
lane marks (and the files' deletion vectors) were read; ``prepared`` once a group is prepared
and before it waits for the table's lock (another node committing there may change what the
group must apply); ``taken`` once a group is taken off the table's queue, before
it is prepared (an error raised there stands for a bug in the committer).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

__all__ = ["fault_point", "set_action"]

_counts: dict[str, int] = {}
_lock = threading.Lock()
_actions: dict[str, Callable[[], None]] = {}


def set_action(name: str, action: Callable[[], None] | None) -> None:
    """Run ``action`` whenever point ``name`` is reached (None: nothing)."""
    if action is None:
        _actions.pop(name, None)
    else:
        _actions[name] = action


def fault_point(name: str) -> None:
    action = _actions.get(name)
    if action is not None:
        action()
    limit = os.environ.get(f"DELTAFLOW_FAULT_KILL_{name.upper()}")
    if not limit:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] >= int(limit):
            os.kill(os.getpid(), signal.SIGKILL)
