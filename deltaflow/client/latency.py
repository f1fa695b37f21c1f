"""Ack latency of a stream: how long its batches took from first send to acknowledgement.

A node acknowledges a batch once its rows are durable in the table, so this is the wait the
group commit adds on top of the network: the commit in progress when the batch arrived, and
its own. It excludes the time items spent in the client before their batch was sent (filling
a page, waiting for the window), which a caller measures from its own clock if it needs
time to table.

Kept in a histogram of fixed memory whatever the stream's length: buckets grow by 2^(1/16)
(4.4%) from 0.1 ms, so a quantile is within about 2% of the true value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Final

__all__ = ["AckLatency", "LatencyHistogram"]

_LOWEST: Final = 1e-4  # seconds: the first bucket's upper bound
_STEPS_PER_DOUBLING: Final = 16
_BUCKETS: Final = 16 * 26  # up to about 1.9 hours; longer waits count in the last bucket


@dataclass(frozen=True, slots=True)
class AckLatency:
    """Quantiles of a stream's ack latency, in seconds: from a batch's first send to its
    acknowledgement (resends included), over its acknowledged batches.

    A node acknowledges a batch once the commit holding its rows landed, so this is what the
    group commit adds: the wait for the commit in progress when the batch arrived, and the
    batch's own commit. It leaves out the time items spent in the client before their batch
    was sent (filling a page, waiting for the window); measure from your own clock for the
    time from an item's production to the table. Quantiles come from a histogram of fixed
    size (buckets 4.4% wide), within about 2% of the exact value.

    Attributes:
        batches: acknowledged batches measured (0: the quantiles are 0.0).
        p50: the median.
        p90: the 90th percentile.
        p99: the 99th percentile.
        max: the longest.
        mean: the mean.
    """

    batches: int = 0
    p50: float = 0.0
    p90: float = 0.0
    p99: float = 0.0
    max: float = 0.0
    mean: float = 0.0


class LatencyHistogram:
    """Durations counted in logarithmic buckets (see the module docstring)."""

    __slots__ = ("_counts", "_max", "_n", "_sum")

    def __init__(self) -> None:
        self._counts = [0] * (_BUCKETS + 1)
        self._n = 0
        self._sum = 0.0
        self._max = 0.0

    def observe(self, seconds: float) -> None:
        if seconds <= _LOWEST:
            index = 0
        else:
            index = min(_BUCKETS, 1 + int(math.log2(seconds / _LOWEST) * _STEPS_PER_DOUBLING))
        self._counts[index] += 1
        self._n += 1
        self._sum += seconds
        self._max = max(self._max, seconds)

    def quantile(self, q: float) -> float:
        """The ``q``-quantile: the geometric middle of the bucket holding it (never more than
        the longest duration seen)."""
        if not self._n:
            return 0.0
        rank = q * self._n
        seen = 0
        for index, count in enumerate(self._counts):
            seen += count
            if count and seen >= rank:
                if index == 0:
                    return min(_LOWEST, self._max)
                middle = _LOWEST * 2 ** ((index - 0.5) / _STEPS_PER_DOUBLING)
                return min(middle, self._max)
        return self._max

    def summary(self) -> AckLatency:
        if not self._n:
            return AckLatency()
        return AckLatency(
            batches=self._n,
            p50=self.quantile(0.5),
            p90=self.quantile(0.9),
            p99=self.quantile(0.99),
            max=self._max,
            mean=self._sum / self._n,
        )
