"""Values into a table's columns: the one conversion rule, for dict rows and Arrow pages alike.

A value reaches a Delta column as a dict row's Python value or in an Arrow page's column. Both
take one path: the values become an Arrow column of their own type (a page's column as sent,
a dict row's values as Arrow reads Python values), and :func:`convert_column` converts that
column to the table's type by one rule:

- **Exact or refused.** A value is converted only where the table then holds the same value:
  an int into a float column where the float holds it exactly, a float into an int column
  where it has no fractional part and fits, a decimal rescaled without losing digits,
  a timestamp to a coarser unit only where nothing is cut. Anything else is refused with the
  item, its column, the table's type and the value; nothing is rounded, truncated or clamped.
- **Kinds do not mix.** Numbers convert among themselves (integers, floats, decimals) under
  the rule above; a string never becomes a number or the other way round, a bool is not a
  number, a date is not a timestamp, binary is not a string.
- **Time zones do not appear or vanish.** An aware timestamp goes only into a ``timestamp``
  column (an instant, stored in UTC), a naive one only into ``timestamp_ntz``.
- **The one rounding that is the column's own**: a float (64-bit) into a ``float`` (32-bit)
  column is stored at the column's precision, as every SQL engine stores it; a value beyond
  that type's range is refused.

The table in docs/tables.md ("Value conversions") lists every accepted conversion.

Dict rows whose Python types already are the column's (ints into a long column, strs into a
string column...) are built straight in the table's type, which Arrow does exactly; only a
column holding other types takes the inference path.
"""

from __future__ import annotations

import datetime
import decimal
import math
from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, Final

from ..errors import SchemaError
from .settings import type_name

__all__ = [
    "Refused",
    "column_of",
    "convert_column",
    "infer_column",
    "refusal",
    "table_type",
]

_NUMBERS: Final = frozenset({"integer", "floating", "decimal"})
#: Python types a column of each kind is built from directly (Arrow checks their range and
#: scale); values of any other type take the inference path and the rule.
_DIRECT: Final[dict[str, frozenset[type]]] = {
    "integer": frozenset({int}),
    "floating": frozenset({float, int}),
    "decimal": frozenset({decimal.Decimal, int}),
    "string": frozenset({str}),
    "binary": frozenset({bytes}),
    "boolean": frozenset({bool}),
    "date": frozenset({datetime.date}),
    "timestamp": frozenset({datetime.datetime}),
    "timestamp_ntz": frozenset({datetime.datetime}),
}
#: The scale of decimal columns that dict rows add to a table (Spark's default for Python
#: decimals); explicit creation (``deltaflow table create``) chooses any other.
NEW_DECIMAL_SCALE: Final = 18
_MAX_PRECISION: Final = 38


class Refused(Exception):
    """Value ``index`` of a column cannot be stored in the table's type: ``why``."""

    def __init__(self, index: int, why: str) -> None:
        super().__init__(index, why)
        self.index = index
        self.why = why


def refusal(
    refused: Refused, *, column: str, target: Any, value: Any, table: str, node: str
) -> SchemaError:
    """The :class:`SchemaError` a refused value becomes: it names the item (its index in the
    batch, which the client turns into the source position and key), the column, the table's
    type and the value."""
    shown = f"{value!r:.80} ({type(value).__name__})"
    reason = f"column {column!r} of table {table!r} is {type_name(target)}; {shown} {refused.why}"
    return SchemaError(
        f"item #{refused.index} of the batch: {reason}",
        node=node,
        details={
            "item": refused.index,
            "column": column,
            "table_type": type_name(target),
            "value": f"{value!r:.80}",
            "reason": reason,
        },
    )


def convert_column(column: Any, field: Any, *, table: str, node: str) -> Any:
    """``column`` (an Arrow array or chunked array) in the type of ``field``, by the rule.

    Raises:
        SchemaError: naming the first value that cannot be stored exactly.
    """
    import pyarrow as pa

    if column.type == field.type:
        return column
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    try:
        return _convert(array, field.type)
    except Refused as refused:
        value = array[refused.index].as_py()
        raise refusal(
            refused, column=field.name, target=field.type, value=value, table=table, node=node
        ) from None


def column_of(values: Sequence[Any], field: Any, *, table: str, node: str) -> Any:
    """The Python ``values`` of one column of dict rows, in the type of ``field``.

    Raises:
        SchemaError: naming the first value that cannot be stored exactly.
    """
    import pyarrow as pa

    target = field.type
    kind = _kind(target)
    kinds = set(map(type, values))
    kinds.discard(type(None))
    if not kinds:
        return pa.nulls(len(values), target)
    try:
        if datetime.datetime in kinds:
            _check_zones(values, kind)
        if kinds <= _DIRECT.get(kind, frozenset()):
            try:
                built = pa.array(values, type=target)
            except (pa.ArrowException, TypeError, ValueError, OverflowError):
                pass  # the rule below names the value
            else:
                if not (kind == "floating" and target.bit_width == 32 and _any_inf(built)):
                    return built
        return _convert(_inferred(values, target), target)
    except Refused as refused:
        raise refusal(
            refused,
            column=field.name,
            target=target,
            value=values[refused.index],
            table=table,
            node=node,
        ) from None


def infer_column(values: Sequence[Any], column: str, *, table: str, node: str) -> Any:
    """The Python ``values`` of a column the table does not have yet, typed as the table
    will hold it (:func:`table_type`).

    Raises:
        SchemaError: values of kinds that do not mix (the first one that differs is named).
    """
    import pyarrow as pa

    try:
        if any(type(v) is datetime.datetime for v in values):
            first = next(v for v in values if type(v) is datetime.datetime)
            _check_zones(values, "timestamp" if _aware(first) else "timestamp_ntz")
        try:
            inferred = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            at = _shortest_failing_prefix(len(values), lambda n: _fails(pa.array, values[:n]))
            raise Refused(at, _mixed(values, at)) from None
        return _convert(inferred, table_type(inferred.type, from_rows=True))
    except Refused as refused:
        value = values[refused.index]
        raise SchemaError(
            f"item #{refused.index} of the batch: column {column!r} of table {table!r} is new, "
            f"and {value!r:.80} ({type(value).__name__}) {refused.why}",
            node=node,
            details={"item": refused.index, "column": column, "value": f"{value!r:.80}"},
        ) from None


def table_type(t: Any, *, from_rows: bool = False) -> Any:
    """The type a new column of Arrow type ``t`` gets in the table: Delta's own kinds
    (timestamps in microseconds, in UTC when aware; signed integers; plain strings and
    binaries). ``from_rows``: the type was inferred from Python values, so decimals get room
    for later values (precision 38, scale at least 18) rather than the first batch's digits."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return table_type(t.value_type, from_rows=from_rows)
    if pa.types.is_timestamp(t):
        return pa.timestamp("us", tz="UTC" if t.tz is not None else None)
    if pa.types.is_unsigned_integer(t):
        return {8: pa.int16(), 16: pa.int32()}.get(t.bit_width, pa.int64())
    if pa.types.is_float16(t):
        return pa.float32()
    if pa.types.is_date64(t):
        return pa.date32()
    if _kind(t) == "string":
        return pa.string()
    if _kind(t) == "binary" and not pa.types.is_fixed_size_binary(t):
        return pa.binary()
    if pa.types.is_decimal(t) and from_rows:
        whole = t.precision - t.scale
        scale = max(t.scale, NEW_DECIMAL_SCALE)
        if whole + scale > _MAX_PRECISION:
            scale = max(t.scale, _MAX_PRECISION - whole)
        return pa.decimal128(_MAX_PRECISION, min(scale, _MAX_PRECISION))
    return t


# -- the rule ------------------------------------------------------------------------------


def _kind(t: Any) -> str:
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return _kind(t.value_type)
    checks: tuple[tuple[Callable[[Any], bool], str], ...] = (
        (pa.types.is_boolean, "boolean"),
        (pa.types.is_integer, "integer"),
        (pa.types.is_floating, "floating"),
        (pa.types.is_decimal, "decimal"),
        (pa.types.is_date, "date"),
        (pa.types.is_time, "time"),
        (pa.types.is_duration, "duration"),
        (pa.types.is_struct, "struct"),
        (pa.types.is_map, "map"),
        (pa.types.is_null, "null"),
    )
    for check, kind in checks:
        if check(t):
            return kind
    if pa.types.is_timestamp(t):
        return "timestamp" if t.tz is not None else "timestamp_ntz"
    text = str(t)
    if pa.types.is_string(t) or pa.types.is_large_string(t) or text == "string_view":
        return "string"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or text == "binary_view":
        return "binary"
    if pa.types.is_fixed_size_binary(t):
        return "binary"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return "list"
    if text.startswith(("list_view", "large_list_view")):
        return "list"
    return text


_WORDS: Final = {
    "boolean": "a bool",
    "integer": "an integer",
    "floating": "a float",
    "decimal": "a decimal",
    "string": "a string",
    "binary": "bytes",
    "date": "a date",
    "timestamp": "an aware timestamp",
    "timestamp_ntz": "a naive timestamp (no time zone)",
    "time": "a time of day",
    "duration": "a duration",
    "list": "a list",
    "struct": "a struct",
    "map": "a map",
}


def _convert(array: Any, target: Any) -> Any:
    """``array`` (one chunk) in type ``target``, by the rule.

    Raises:
        Refused: the first value that cannot be stored exactly.
    """
    import pyarrow as pa

    if pa.types.is_dictionary(array.type):
        array = array.dictionary_decode()
    source = array.type
    if source == target:
        return array
    if pa.types.is_null(source):
        return pa.nulls(len(array), target)
    ks, kt = _kind(source), _kind(target)
    if not (ks == kt or (ks in _NUMBERS and kt in _NUMBERS)) or not _leaves_convert(source, target):
        raise Refused(_first_value(array), _kind_why(ks, kt, target))
    out = _cast(array, target)
    if ks in _NUMBERS:
        bad = _overflowed(out, array) if ks == kt == "floating" else _changed(out, array)
        if bad is not None:
            raise Refused(bad, _number_why(array[bad].as_py(), ks, target))
    return out


def _cast(array: Any, target: Any) -> Any:
    """Arrow's safe cast (it refuses truncation, overflow and lost digits), with integers
    into decimals by way of a decimal wide enough for any integer."""
    import pyarrow as pa

    def cast(part: Any) -> Any:
        if pa.types.is_integer(part.type) and pa.types.is_decimal(target):
            part = part.cast(pa.decimal256(76, target.scale))
        return part.cast(target, safe=True)

    try:
        return cast(array)
    except (pa.ArrowException, ValueError, OverflowError):
        at = _first_failing(len(array), lambda start, n: _fails(cast, array.slice(start, n)))
        raise Refused(at, _number_why(array[at].as_py(), _kind(array.type), target)) from None


def _fails(operation: Callable[[Any], Any], part: Any) -> bool:
    try:
        operation(part)
    except Exception:  # noqa: BLE001 - any failure of the operation is what is looked for
        return True
    return False


def _first_failing(count: int, fails: Callable[[int, int], bool]) -> int:
    """The first index at which an element-wise operation fails, given that it fails on the
    whole: by halving, so O(log n) calls of ``fails(start, length)``."""
    lo, n = 0, count
    while n > 1:
        half = n // 2
        if fails(lo, half):
            n = half
        else:
            lo, n = lo + half, n - half
    return lo


def _shortest_failing_prefix(count: int, fails: Callable[[int], bool]) -> int:
    """The index of the last value of the shortest prefix on which ``fails(n)`` holds: the
    first value that does not mix with those before it."""
    low, high = 1, count
    while low < high:
        mid = (low + high) // 2
        if fails(mid):
            high = mid
        else:
            low = mid + 1
    return low - 1


def _changed(out: Any, array: Any) -> int | None:
    """The first value that ``out`` does not hold exactly (converted back, it differs), for
    the conversions Arrow's cast rounds (floats to and from decimals)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not (pa.types.is_decimal(out.type) or pa.types.is_decimal(array.type)):
        return None
    if pa.types.is_integer(out.type) or pa.types.is_integer(array.type):
        return None  # Arrow refuses lost digits and overflow between decimals and integers
    if pa.types.is_decimal(out.type) and pa.types.is_decimal(array.type):
        return None
    back = out.cast(array.type, safe=False)
    differs = pc.fill_null(pc.not_equal(back, array), False)
    return int(pc.index(differs, True).as_py()) if pc.any(differs).as_py() else None


def _overflowed(out: Any, array: Any) -> int | None:
    """The first finite value that became infinite in a narrower float column."""
    import pyarrow.compute as pc

    became = pc.fill_null(pc.and_(pc.is_inf(out), pc.invert(pc.is_inf(array))), False)
    return int(pc.index(became, True).as_py()) if pc.any(became).as_py() else None


def _any_inf(array: Any) -> bool:
    """Whether a float column holds an infinity (built from Python floats: one may be an
    overflow, which the rule then finds)."""
    import pyarrow.compute as pc

    return bool(pc.any(pc.fill_null(pc.is_inf(array), False)).as_py())


def _leaves_convert(source: Any, target: Any) -> bool:
    """Nested types: each leaf pair converts without a rounding Arrow cannot check (floats
    to or from decimals and narrowing floats are refused inside lists, structs and maps)."""
    import pyarrow as pa

    ks, kt = _kind(source), _kind(target)
    if ks in ("list", "map"):
        return (
            ks == kt
            and _leaves_convert(source.value_type, target.value_type)
            and (ks != "map" or _leaves_convert(source.key_type, target.key_type))
        )
    if ks == "struct":
        if kt != "struct":
            return False
        theirs = {f.name: f.type for f in source}
        return all(_leaves_convert(theirs[f.name], f.type) for f in target if f.name in theirs)
    if source is target or source == target or pa.types.is_null(source):
        return True
    if ks != kt and not (ks in _NUMBERS and kt in _NUMBERS):
        return False
    return True


def _first_value(array: Any) -> int:
    import pyarrow.compute as pc

    valid = pc.is_valid(array)
    return int(pc.index(valid, True).as_py()) if pc.any(valid).as_py() else 0


def _kind_why(ks: str, kt: str, target: Any) -> str:
    if {ks, kt} == {"timestamp", "timestamp_ntz"}:
        if kt == "timestamp":
            return (
                "has no time zone, so the instant it means is unknown: send aware datetimes "
                "(datetime.replace(tzinfo=...)), or write it to a timestamp_ntz column"
            )
        return (
            "has a time zone, which a timestamp_ntz column (local wall-clock time) would drop: "
            "send naive datetimes, or write it to a timestamp column"
        )
    what = _WORDS.get(ks, ks)
    return f"is {what}, which is not converted to {type_name(target)}"


def _number_why(value: Any, ks: str, target: Any) -> str:
    import pyarrow as pa

    kt = _kind(target)
    if isinstance(value, float) and not math.isfinite(value):
        return "is not a finite number, which this column cannot hold"
    if kt == "integer":
        if isinstance(value, (float, decimal.Decimal)) and value == value and value % 1:
            return "has a fractional part; it is refused rather than truncated"
        bits = target.bit_width
        return f"is out of the column's range ({-(2 ** (bits - 1))} to {2 ** (bits - 1) - 1})"
    if kt == "floating":
        if ks == "floating":
            return f"is beyond the range of {type_name(target)}"
        limit = "2**53" if target.bit_width == 64 else "2**24"
        return f"is not held exactly by {type_name(target)} (integers only up to {limit})"
    if kt == "decimal":
        whole = target.precision - target.scale
        return (
            f"does not fit {type_name(target)} exactly (at most {whole} digits before the "
            f"point and {target.scale} after); it is refused rather than rounded"
        )
    if pa.types.is_timestamp(target) or pa.types.is_time(target) or kt == "duration":
        return f"is finer than the column's unit ({target.unit}); it is refused rather than cut"
    return f"does not convert to {type_name(target)} exactly"


def _mixed(values: Sequence[Any], at: int) -> str:
    first = next((v for v in values if v is not None), None)
    return f"does not share a type with the column's earlier values ({type(first).__name__})"


def _aware(value: datetime.datetime) -> bool:
    return value.tzinfo is not None and value.tzinfo.utcoffset(value) is not None


def _check_zones(values: Sequence[Any], kind: str) -> None:
    """Datetimes must all be aware for a ``timestamp`` column and all naive for a
    ``timestamp_ntz`` one (Arrow would make one kind the other silently)."""
    if kind not in ("timestamp", "timestamp_ntz"):
        return
    want = kind == "timestamp"
    for i, value in enumerate(values):
        if type(value) is datetime.datetime and _aware(value) != want:
            other = "timestamp_ntz" if want else "timestamp"
            raise Refused(i, _kind_why(other, kind, None))


def _inferred(values: Sequence[Any], target: Any) -> Any:
    """The values as Arrow reads Python values; a value whose type does not mix with the
    others is refused by the rule, as it would be alone."""
    import pyarrow as pa

    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        pass
    for i, value in enumerate(values):
        if value is None:
            continue
        try:
            alone = pa.array([value])
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            if isinstance(value, int):
                raise Refused(i, "is beyond the range of 64-bit integers") from None
            raise Refused(i, "is not a value a table column can hold") from None
        try:
            _convert(alone, target)
        except Refused as refused:
            raise Refused(i, refused.why) from None
    # Every value converts alone but not together (say ints and floats beyond 2**53).
    at = _shortest_failing_prefix(len(values), lambda n: _fails(pa.array, values[:n]))
    raise Refused(at, _mixed(values, at))


def transpose(rows: Sequence[Any], names: Sequence[str]) -> list[list[Any]]:
    """The values of columns ``names`` of dict ``rows``, one list per column (None where a
    row lacks the column)."""
    columns = []
    for name in names:
        try:
            columns.append(list(map(itemgetter(name), rows)))  # C speed when every row has it
        except KeyError:
            columns.append([row.get(name) for row in rows])
    return columns
