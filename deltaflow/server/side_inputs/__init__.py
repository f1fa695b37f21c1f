"""Side inputs on a node: one leader retrieves, the warehouse stores, every node watches.

This is Numaflow's Side Inputs design with the shared warehouse directory as its data store
and its leader election (see ``docs/side-inputs.md``). Each side input has a directory::

    <warehouse>/.deltaflow/side_inputs/<name>/
        lock            flock target: every change of ``lease`` or ``CURRENT`` holds it
        lease           {"holder", "instance", "epoch", "expires", "last_run"}      (JSON)
        CURRENT         {"version", "bytes", "sha256", "node", "created"}          (JSON)
        v00000042.bin   the value of version 42; never rewritten once CURRENT names it
        error           the leader's latest failed retrieval; removed by the next success

Every file is written to a temporary name and moved into place with ``os.replace``, so a
reader sees a whole old file or a whole new one.

On every node, for each side input:

- the **lease loop** (:mod:`.lease`) tries to take or renew the lease every ``lease / 3``
  seconds, under the lock: a node takes it when it is free, expired or its own, and writes
  itself in as holder until ``now + lease``. When a leader dies, its lease runs out and another
  node takes it at its next try: within ``lease * 4 / 3`` of the leader's last renewal.
- the **retrieval loop** (:mod:`.retrieval`) runs only while the node holds the lease: it
  calls the user's ``retrieve()`` when due and publishes a new version. Publishing checks,
  under the lock, that the lease is still this node's and unexpired (a fence: a leader that
  stalled past its lease and was replaced cannot overwrite the new leader's value).

On every node, one **watcher** (:mod:`.watcher`) reads each ``CURRENT`` every
``poll_interval`` seconds. When it names a newer version, the watcher reads the version file,
checks its size and SHA-256 against ``CURRENT``, and swaps it in by replacing one reference. A
version is immutable: readers (receivers, on the loop or in worker threads) get the old
version or the new one, never a mix, and each version parses once per parse function
(:mod:`.version`).

The files live behind :mod:`.directory`; :mod:`.store` holds a node's side inputs and starts
their tasks; :mod:`.schedule` and :mod:`.loading` check the classes an operator names.
"""

from ..statistics import SideInputStatistics
from .loading import load_side_inputs
from .store import (
    DEFAULT_SIDE_INPUT_LEASE,
    DEFAULT_SIDE_INPUT_POLL_INTERVAL,
    DEFAULT_SIDE_INPUT_TIMEOUT,
    SideInputStore,
)

__all__ = [
    "DEFAULT_SIDE_INPUT_LEASE",
    "DEFAULT_SIDE_INPUT_POLL_INTERVAL",
    "DEFAULT_SIDE_INPUT_TIMEOUT",
    "SideInputStatistics",
    "SideInputStore",
    "load_side_inputs",
]
