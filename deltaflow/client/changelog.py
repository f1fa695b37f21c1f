"""Change feeds as a stream's input: each event becomes the row it upserts or the key it deletes.

``stream_data(events, table=..., key=..., changelog=...)`` takes, instead of rows:

- ``"debezium"``: Debezium change events (the envelope's ``before``, ``after``, ``op``,
  ``source`` and ``ts_ms``, bare or inside Kafka Connect's ``{"schema": ..., "payload": ...}``).
  ``op`` ``c`` (create), ``r`` (snapshot read) and ``u`` (update) upsert ``after``; ``d``
  deletes the key of ``before``. A Kafka tombstone (a ``None`` event after a delete) is
  skipped; so are ``t`` (truncate) and ``m`` (message) events, which change no row: they
  are counted and logged (a warning at the first, the counts when the source ends), and the
  stream goes on.
- :class:`Changelog`: flat rows with an operation column (``op=``) whose values in
  ``delete_when`` delete the row's key; the column itself is not written (``keep_op=True``
  keeps it). Arrow batches too: their delete flags come from the column.

With ``sequence_by``, each change carries its sequence: a Debezium event takes a sequence
column from the row, else from the ``source`` block by the same name (Postgres ``lsn``, MySQL
``file`` and ``pos``), else the envelope's ``ts_ms``; a :class:`Changelog` row carries it
itself. The items a stream reports (failures, ``on_ack``) are the converted rows.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from ..columnar import DELETE_COLUMN, is_arrow
from ..errors import UsageError
from .stream_types import Delete

__all__ = ["DEBEZIUM", "Changelog", "convert_changelog"]

#: ``changelog=DEBEZIUM``: the source yields Debezium change events.
DEBEZIUM: Final = "debezium"
_UPSERT_OPS: Final = frozenset({"c", "r", "u"})
#: Debezium's events that change no row (truncate, message): skipped, never a stream's end.
_SKIPPED_OPS: Final = {"t": "truncate", "m": "message"}

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Changelog:
    """A change feed of flat rows: the column ``op`` says what each row does.

    Attributes:
        op: the operation column.
        delete_when: its values that mean "delete this row's key"; any other value upserts.
        keep_op: write the operation column into the table too (default: dropped).
    """

    op: str = "op"
    delete_when: tuple[Any, ...] = ("d", "D")
    keep_op: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.op, str) or not self.op:
            raise UsageError("Changelog(op=...) names the operation column")
        if isinstance(self.delete_when, (str, bytes)) or not isinstance(self.delete_when, Iterable):
            raise UsageError("Changelog(delete_when=...) is a tuple of values, e.g. ('d', 'D')")
        object.__setattr__(self, "delete_when", tuple(self.delete_when))

    def convert(self, item: Any, position: int) -> Any:
        if is_arrow(type(item)):
            return self._convert_arrow(item)
        if not isinstance(item, Mapping):
            raise UsageError(
                f"changelog item #{position} is a {type(item).__name__}, not a row (a map)"
            )
        if self.op not in item:
            raise UsageError(
                f"changelog item #{position} has no operation column {self.op!r}: {_brief(item)}"
            )
        row = dict(item) if self.keep_op else {k: v for k, v in item.items() if k != self.op}
        return Delete(row) if item[self.op] in self.delete_when else row

    def _convert_arrow(self, batch: Any) -> Any:
        """An Arrow batch with the operation column as one with the delete flag column."""
        import pyarrow as pa
        import pyarrow.compute as pc

        table = pa.Table.from_batches([batch]) if isinstance(batch, pa.RecordBatch) else batch
        if self.op not in table.column_names:
            raise UsageError(f"an Arrow batch of the changelog has no column {self.op!r}")
        if DELETE_COLUMN in table.column_names:
            raise UsageError(
                f"an Arrow batch of the changelog has both {self.op!r} and {DELETE_COLUMN!r}"
            )
        flags = pc.fill_null(
            pc.is_in(table.column(self.op), value_set=pa.array(self.delete_when)), False
        )
        if not self.keep_op:
            table = table.drop_columns([self.op])
        return table.append_column(DELETE_COLUMN, flags)


@dataclass(slots=True)
class _Skipped:
    """The events of one stream's source that were skipped: counted by kind, logged once."""

    counts: dict[str, int] = field(default_factory=dict)

    def note(self, op: str, position: int) -> None:
        kind = _SKIPPED_OPS[op]
        if not self.counts:
            log.warning(
                "changelog item #%d is a Debezium %s event (op %r): skipped, it changes no row "
                "(a truncate is not applied to the table; the count of skipped events is "
                "logged when the source ends)",
                position,
                kind,
                op,
            )
        self.counts[kind] = self.counts.get(kind, 0) + 1

    def report(self) -> None:
        if self.counts:
            done = ", ".join(f"{n} {kind}" for kind, n in sorted(self.counts.items()))
            log.warning("changelog source ended: skipped %s event(s) (Debezium)", done)


@dataclass(frozen=True, slots=True)
class _Debezium:
    """Debezium change events (see the module docstring)."""

    sequence: tuple[str, ...]
    skipped: _Skipped = field(default_factory=_Skipped)

    def convert(self, event: Any, position: int) -> Any:
        if event is None:
            return None  # a Kafka tombstone: the delete before it did the work
        if not isinstance(event, Mapping):
            raise UsageError(
                f"changelog item #{position} is a {type(event).__name__}, not a Debezium event"
            )
        if "payload" in event and "op" not in event:  # Kafka Connect's JSON with schemas
            event = event["payload"]
            if event is None:
                return None
            if not isinstance(event, Mapping):
                raise UsageError(f"changelog item #{position}: its payload is not an event")
        op = event.get("op")
        if op in _UPSERT_OPS:
            row = event.get("after")
        elif op == "d":
            row = event.get("before")
        elif isinstance(op, str) and op in _SKIPPED_OPS:
            self.skipped.note(op, position)
            return None
        else:
            raise UsageError(
                f"changelog item #{position} has op {op!r}; a Debezium event has op c, r, u, "
                f"d, t (truncate, skipped) or m (message, skipped): {_brief(event)}"
            )
        if not isinstance(row, Mapping):
            side = "before" if op == "d" else "after"
            raise UsageError(
                f"changelog item #{position} (op {op!r}) has no {side!r} row: {_brief(event)}"
            )
        row = dict(row)
        for column in self.sequence:
            if row.get(column) is None:
                row[column] = self._sequence(event, column, position)
        return Delete(row) if op == "d" else row

    @staticmethod
    def _sequence(event: Mapping[str, Any], column: str, position: int) -> Any:
        source = event.get("source")
        if isinstance(source, Mapping) and source.get(column) is not None:
            return source[column]
        if event.get("ts_ms") is not None:
            return event["ts_ms"]
        raise UsageError(
            f"changelog item #{position} has no sequence {column!r}: not in its row, its source "
            f"block, nor a ts_ms: {_brief(event)}"
        )


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "..."


def converter(changelog: Any, sequence: Sequence[str]) -> Changelog | _Debezium:
    """What ``changelog=`` names, checked."""
    if isinstance(changelog, Changelog):
        return changelog
    if changelog == DEBEZIUM:
        return _Debezium(tuple(sequence))
    raise UsageError(
        f"changelog={changelog!r}: use 'debezium' or deltaflow.Changelog(op=..., delete_when=...)"
    )


def convert_changelog(source: Any, changelog: Any, sequence: Sequence[str]) -> Any:
    """``source`` (an iterable, async iterable or Observable of change events) as the rows and
    deletes they mean (see the module docstring); converted as they are pulled, so a blocking
    source is still read off the event loop."""
    spec = converter(changelog, sequence)
    convert = spec.convert
    ended: Callable[[], None] = spec.skipped.report if isinstance(spec, _Debezium) else _nothing

    if isinstance(source, AsyncIterable):

        async def rows_async() -> Any:
            position = 0
            async for event in source:
                row = convert(event, position)
                position += 1
                if row is not None:
                    yield row
            ended()

        return rows_async()
    try:
        from reactivex import Observable
        from reactivex import operators as ops
    except ImportError:  # pragma: no cover - reactivex is a dependency
        Observable = None  # type: ignore[assignment,misc]
    if Observable is not None and isinstance(source, Observable):
        counter = iter(range(1 << 62))
        return source.pipe(
            ops.map(lambda event: convert(event, next(counter))),
            ops.filter(lambda row: row is not None),
            ops.do_action(on_completed=ended),
        )
    if isinstance(source, (str, bytes, Mapping)) or not isinstance(source, Iterable):
        return source  # refused by the stream as any source of that kind is

    def rows() -> Any:
        for position, event in enumerate(source):
            row = convert(event, position)
            if row is not None:
                yield row
        ended()

    return rows()


def _nothing() -> None:
    pass
