"""Side inputs on a node: one leader retrieves, the warehouse stores, every node watches.

This is Numaflow's Side Inputs design with the shared warehouse as its data store and its
leader election (see ``docs/side-inputs.md``). The warehouse may be a directory or a prefix on
an object store: nothing here needs a lock the hosts share. Each side input has a place::

    <warehouse>/.deltaflow/side_inputs/<name>/
        state                   {"lease": {"holder", "instance", "epoch", "expires",
                                 "last_run"}, "current": {"version", "bytes", "sha256",
                                 "file", "node", "created"}}                        (JSON)
        v00000042-<sha>.bin     the value of version 42; never rewritten
        error                   the leader's latest failed retrieval; removed by the next success

``state`` is only ever replaced by compare-and-swap (an ETag-conditional put on a store, a
compare under an ``flock`` on disk: :mod:`deltaflow.storage.records`), and every other file is
written whole, so a reader sees a whole old record or a whole new one.

On every node, for each side input:

- the **lease loop** (:mod:`.lease`) tries to take or renew the lease every ``lease / 3``
  seconds: a node takes it when it is free, expired or its own, and writes itself in as holder
  until ``now + lease``, by one swap of ``state``. When a leader dies, its lease runs out and
  another node takes it at its next try: within ``lease * 4 / 3`` of the leader's last
  renewal. Expiry compares wall clocks, so the hosts' clocks must agree to well within a lease.
- the **retrieval loop** (:mod:`.retrieval`) runs only while the node holds the lease: it
  calls the user's ``retrieve()`` when due and publishes a new version. The publish is one
  swap of ``state`` from a read in which the lease was this node's and unexpired, so it fails
  if any other node took the lease meanwhile (a fence: a leader that stalled past its lease and
  was replaced cannot overwrite the new leader's value).

On every node, one **watcher** (:mod:`.watcher`) reads each ``state`` every
``poll_interval`` seconds. When it names a newer version, the watcher reads the version file,
checks its size and SHA-256 against ``state``, and swaps it in by replacing one reference. A
version is immutable: readers (receivers, on the loop or in worker threads) get the old
version or the new one, never a mix, and each version parses once per parse function
(:mod:`.version`).

The records live behind :mod:`.directory`; :mod:`.store` holds a node's side inputs and starts
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
