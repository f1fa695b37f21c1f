"""The side-input base class: slow-changing data retrieved centrally, read by every receiver."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import ClassVar, Final

__all__ = ["DEFAULT_RETRIEVE_TIMEOUT", "MAX_SIDE_INPUT_BYTES", "SideInput"]

#: The largest value a side input may broadcast: 1 MiB, as in Numaflow's design.
MAX_SIDE_INPUT_BYTES: Final = 1024 * 1024
#: Seconds one ``retrieve()`` call may take before it counts as failed.
DEFAULT_RETRIEVE_TIMEOUT: Final = 60.0


class SideInput:
    """Base class of side inputs: subclass it, and register the class on every node.

    A side input is slow-changing data (configuration, a lookup table, up to 1 MiB) that
    receivers need without loading it per batch. One node of the cluster, the side input's
    *leader*, calls :meth:`retrieve` on a schedule and stores the bytes it returns once, as a
    new version, in the shared warehouse; every node picks the new version up and swaps it in
    atomically; receivers read it with ``ctx.side_input(name, parse=...)``. This follows
    Numaflow's Side Inputs design; see ``docs/side-inputs.md`` for the lease, the versions and
    the timing.

    Class attributes:

    - ``name``: what receivers pass to ``ctx.side_input``. Default: the class's ``__name__``.
      Letters, digits, ``_``, ``.`` and ``-``, at most 128, not starting with ``.`` or ``-``.
    - ``interval``: retrieve every this many seconds (from the start of the previous run).
    - ``cron``: or retrieve on a cron schedule, e.g. ``"*/15 * * * *"`` (5 fields; a 6th field
      is seconds, as in ``croniter``). Give exactly one of ``interval`` and ``cron``.
    - ``timezone``: the IANA zone ``cron`` is read in. Default ``"UTC"``.
    - ``timeout``: seconds one ``retrieve()`` may take before it counts as failed. Default 60.

    A leader retrieves at once when the side input has no value yet, or when a run is overdue
    (after a takeover); then on the schedule. A failed retrieval (it raised, timed out, or
    returned something too large or not bytes) keeps the current value and is retried with
    backoff from 0.5 s doubling up to 30 s, never later than the next scheduled run.

    The node builds one instance per side input (``cls()``, no arguments) when it is created.
    """

    name: ClassVar[str | None] = None
    interval: ClassVar[float | None] = None
    cron: ClassVar[str | None] = None
    timezone: ClassVar[str] = "UTC"
    timeout: ClassVar[float] = DEFAULT_RETRIEVE_TIMEOUT

    def retrieve(self) -> bytes | Awaitable[bytes | None] | None:
        """Fetch the side input's current value, as bytes.

        Define it as ``def`` or ``async def``. A plain ``def`` runs in a worker thread, so it
        may block (read a file, query a database); an ``async def`` runs on the node's event
        loop and must not block. Only the leader node calls it, one call at a time.

        Returns:
            The value (at most :data:`MAX_SIDE_INPUT_BYTES`), stored as a new version if it
            differs from the current one; or ``None`` to decline: no new version is made and
            every node keeps the current value.

        Raises:
            Exception: any error counts as a failed retrieval: it is logged, the current value
                stays, and the retrieval is retried with backoff.
        """
        raise NotImplementedError(f"{type(self).__qualname__} must define retrieve()")

    @classmethod
    def side_input_name(cls) -> str:
        """The name receivers read this side input by."""
        return cls.name or cls.__name__
