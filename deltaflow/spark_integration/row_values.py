"""Spark rows as msgpack values: which column types can travel, and the conversion of a Row
into a dict of msgpack values (run on the executors, once per Spark partition).

Importing this module does not import PySpark.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import UsageError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame
    from pyspark.sql.types import DataType, StructType

__all__ = ["Converter", "checked_schema", "row_converter"]

Converter = Callable[[Any], Any]


def checked_schema(df: DataFrame) -> StructType:
    """``df``'s schema, after checking every column can travel as a msgpack value."""
    schema = df.schema
    names = [f.name for f in schema.fields]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise UsageError(
            f"the DataFrame has duplicate column names {duplicates}; rows become dicts, so "
            "rename or drop them first (e.g. after a join, select the columns you need)"
        )
    problems: list[str] = []
    for field in schema.fields:
        _unsupported(field.dataType, field.name, problems)
    if problems:
        raise UsageError(
            "these columns cannot be streamed as they are: "
            + "; ".join(problems)
            + ". Cast them first, e.g. df.withColumn(name, F.col(name).cast('string'))"
        )
    return schema


def _unsupported(dtype: DataType, path: str, problems: list[str]) -> None:
    from pyspark.sql import types as T

    hint: str | None = None
    if isinstance(dtype, (T.DayTimeIntervalType, T.YearMonthIntervalType)):
        hint = "convert to a number (e.g. seconds or months as 'long')"
    elif isinstance(dtype, T.UserDefinedType):
        hint = "convert it to its underlying SQL type"
    elif isinstance(dtype, T.NullType):
        hint = "it is always null, so its type cannot be inferred; cast to the intended type"
    elif isinstance(dtype, T.StructType):
        for field in dtype.fields:
            _unsupported(field.dataType, f"{path}.{field.name}", problems)
    elif isinstance(dtype, T.ArrayType):
        _unsupported(dtype.elementType, f"{path}[]", problems)
    elif isinstance(dtype, T.MapType):
        _unsupported(dtype.keyType, f"{path}{{key}}", problems)
        _unsupported(dtype.valueType, f"{path}{{value}}", problems)
    if hint is not None:
        problems.append(f"{path!r} is {dtype.simpleString()}: {hint}")


def row_converter(schema: StructType) -> Converter:
    """A function from a Row of ``schema`` to a dict of msgpack values.

    The same values as ``row.asDict(recursive=True)`` (decimals, dates and ``timestamp_ntz``
    wall-clock times as PySpark gives them), except ``timestamp``: PySpark gives an instant as
    a naive datetime in the worker's local time, which becomes the same instant in UTC (a naive
    datetime would land in a ``timestamp_ntz`` column, or be refused by a ``timestamp`` one).
    """
    convert = _converter(schema)
    assert convert is not None
    return convert


def _converter(dtype: DataType) -> Converter | None:
    """The conversion for values of ``dtype``; None where values pass unchanged."""
    from pyspark.sql import types as T

    if isinstance(dtype, T.TimestampType):
        return _instant_to_utc
    if isinstance(dtype, T.StructType):
        names = tuple(f.name for f in dtype.fields)
        fields = tuple(_converter(f.dataType) for f in dtype.fields)
        if not any(fields):

            def plain_struct(row: Any) -> Any:
                return None if row is None else dict(zip(names, row, strict=True))

            return plain_struct
        pairs = tuple(zip(names, fields, strict=True))

        def struct(row: Any) -> Any:
            if row is None:
                return None
            return {
                name: (value if conv is None else conv(value))
                for (name, conv), value in zip(pairs, row, strict=True)
            }

        return struct
    if isinstance(dtype, T.ArrayType):
        element = _converter(dtype.elementType)
        if element is None:
            return None
        each = element

        def array(values: Any) -> Any:
            return None if values is None else [each(v) for v in values]

        return array
    if isinstance(dtype, T.MapType):
        keys = _converter(dtype.keyType) or _identity
        values = _converter(dtype.valueType) or _identity
        if keys is _identity and values is _identity:
            return None

        def mapping(m: Any) -> Any:
            return None if m is None else {keys(k): values(v) for k, v in m.items()}

        return mapping
    return None


def _identity(value: Any) -> Any:
    return value


def _instant_to_utc(value: Any) -> Any:
    if value is None or value.tzinfo is not None:
        return value
    # PySpark built it with datetime.fromtimestamp (local time, fold set): astimezone reads it
    # back as the same local time, so the instant is exact, also around DST changes.
    return value.astimezone(datetime.UTC)
