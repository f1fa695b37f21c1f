"""When a side input is retrieved: every ``interval`` seconds, or on a cron expression."""

from __future__ import annotations

import datetime
import zoneinfo
from dataclasses import dataclass

from croniter import croniter

from ...errors import UsageError
from ...receivers.side_input import SideInput

__all__ = ["Schedule"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """When a side input is retrieved: every ``interval`` seconds, or on a cron expression."""

    interval: float | None
    cron: str | None
    tz: datetime.tzinfo

    @classmethod
    def of(cls, si: type[SideInput]) -> Schedule:
        name = si.side_input_name()
        if (si.interval is None) == (si.cron is None):
            raise UsageError(
                f"side input {name!r} ({si.__qualname__}) must set exactly one of 'interval' "
                "(seconds) and 'cron' (a cron expression)"
            )
        try:
            tz = zoneinfo.ZoneInfo(si.timezone)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError) as exc:
            raise UsageError(f"side input {name!r}: unknown timezone {si.timezone!r}") from exc
        if si.interval is not None:
            if isinstance(si.interval, bool) or not si.interval > 0:
                raise UsageError(f"side input {name!r}: interval must be > 0 seconds")
            return cls(float(si.interval), None, tz)
        assert si.cron is not None
        if not croniter.is_valid(si.cron):
            raise UsageError(f"side input {name!r}: {si.cron!r} is not a valid cron expression")
        return cls(None, si.cron, tz)

    def next_after(self, t: float) -> float:
        """The first scheduled run after the wall-clock time ``t``."""
        if self.interval is not None:
            return t + self.interval
        assert self.cron is not None
        start = datetime.datetime.fromtimestamp(t, self.tz)
        return float(croniter(self.cron, start).get_next(float))

    def __str__(self) -> str:
        return f"every {self.interval:g}s" if self.interval is not None else f"cron {self.cron!r}"
