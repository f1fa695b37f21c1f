"""Fault points for crash tests (see :mod:`deltaflow.testing`). Inert unless configured.

``DELTAFLOW_FAULT_KILL_AFTER_COMMIT=N`` makes a node process SIGKILL itself right after its
N-th table commit lands and before the batches in it are acknowledged: the "crash between
commit and ack" that exactly-once must survive.
"""

from __future__ import annotations

import os
import signal
import threading

__all__ = ["fault_point"]

_counts: dict[str, int] = {}
_lock = threading.Lock()


def fault_point(name: str) -> None:
    limit = os.environ.get(f"DELTAFLOW_FAULT_KILL_{name.upper()}")
    if not limit:
        return
    with _lock:
        _counts[name] = _counts.get(name, 0) + 1
        if _counts[name] >= int(limit):
            os.kill(os.getpid(), signal.SIGKILL)
