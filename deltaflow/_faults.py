"""Fault points for crash and race tests (see :mod:`deltaflow.testing`). Inert unless
configured.

``DELTAFLOW_FAULT_KILL_AFTER_COMMIT=N`` makes a node process SIGKILL itself right after its
N-th table commit lands and before the batches in it are acknowledged: the "crash between
commit and ack" that exactly-once must survive.

``DELTAFLOW_FAULT_TICK_BEFORE_WRITE=SECONDS`` holds every group's write until the next
multiple of SECONDS of wall-clock time: node processes on one machine then commit to a table on
the same tick, the race optimistic commits on an object store must win or retry safely.
``DELTAFLOW_FAULT_STOP_BEFORE_WRITE=N`` makes a node process SIGSTOP itself the N-th time a
group is about to be written, with its lane marks read: an owner paused mid-commit (a long GC
pause, a frozen VM) that another node replaces, and that resumes when sent SIGCONT.

``DELTAFLOW_FAULT_UNREACHABLE=HOST:PORT,...`` cuts a node off from those peers, as a network
partition would: its polls of them go unanswered (never refused), while clients and the store
stay reachable. Two nodes each given the other's address believe each other dead.
``DELTAFLOW_FAULT_UNREACHABLE_COMMITS=HOST:PORT,...`` cuts only its commit calls to those
peers (they time out), its polls still answered: a committer the map still names that this
writer cannot reach.

In-process, :func:`deltaflow.testing.at_fault_point` runs a function at a point instead, on the
thread that reaches it: ``before_commit`` is reached once a group's data files are written
and before the commit that adds them (another writer committing there is the race the commit
must detect); ``before_listing`` before a group lists the live files it may touch, after the
lane marks (and the files' deletion vectors) were read; ``before_write`` once a group's lane
marks were read for the last time and its commit version chosen, before the engine writes it;
``prepared`` once a group is prepared and before it waits for the table's lock (another node
committing there may change what the group must apply); ``taken`` once a group is taken off the
table's queue, before it is prepared (an error raised there stands for a bug in the committer);
``creating`` once a writer found no table and is about to create it (another writer creating
it there is the creation race); ``applying`` once a batch of a lane is decoded, before its
receiver runs (on the event loop; an error raised there stands for a bug in the dispatcher);
``side_input_publish`` once a side input's leader has read its lease, valid, and written the
new version's file, before it swaps the side input's ``state`` to name it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["fault_point", "set_action", "unreachable", "unreachable_commits"]

_counts: dict[str, int] = {}
_lock = threading.Lock()
_actions: dict[str, Callable[[], None]] = {}


def set_action(name: str, action: Callable[[], None] | None) -> None:
    """Run ``action`` whenever point ``name`` is reached (None: nothing)."""
    if action is None:
        _actions.pop(name, None)
    else:
        _actions[name] = action


def unreachable(address: str) -> bool:
    """Whether ``DELTAFLOW_FAULT_UNREACHABLE`` cuts this process off from the peer at
    ``address``."""
    return _cut("DELTAFLOW_FAULT_UNREACHABLE", address)


def unreachable_commits(address: str) -> bool:
    """Whether ``DELTAFLOW_FAULT_UNREACHABLE_COMMITS`` cuts this process's commit calls to the
    peer at ``address``."""
    return _cut("DELTAFLOW_FAULT_UNREACHABLE_COMMITS", address)


def _cut(variable: str, address: str) -> bool:
    cut = os.environ.get(variable, "")
    return address in cut.split(",") if cut else False


def fault_point(name: str) -> None:
    action = _actions.get(name)
    if action is not None:
        action()
    point = name.upper()
    tick = os.environ.get(f"DELTAFLOW_FAULT_TICK_{point}")
    if tick:
        period = float(tick)
        time.sleep(period - time.time() % period)
    for kind, sig in (("KILL", signal.SIGKILL), ("STOP", signal.SIGSTOP)):
        limit = os.environ.get(f"DELTAFLOW_FAULT_{kind}_{point}")
        if not limit:
            continue
        with _lock:
            key = f"{kind} {name}"
            _counts[key] = _counts.get(key, 0) + 1
            reached = _counts[key] == int(limit) if kind == "STOP" else _counts[key] >= int(limit)
        if reached:
            os.kill(os.getpid(), sig)
