"""A table's CHECK constraints, checked on a batch's rows when they are staged.

Delta enforces a table's CHECK constraints (``delta.constraints.<name>``: a SQL expression each
row must make true) in the commit: a row breaking one fails the whole group's commit, and the
group is then committed batch by batch. Checked when a batch is staged instead, the row is
named (``item #3 ... violated CHECK constraint ...``), its batch alone fails, and under
``on_bad_row="quarantine"`` the row alone goes to the dead-letter table. The expressions are
evaluated by delta-rs's query engine (DataFusion) on the batch written as a small Delta table
of its own, in a temporary directory; a constraint added after the node last read the table
is still enforced by the commit.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Mapping
from typing import Any, Final

from ..columnar import DELETE_COLUMN
from ..errors import SchemaError

log = logging.getLogger(__name__)

__all__ = ["CONSTRAINT_PREFIX", "check_constraints"]

#: The table properties that hold CHECK constraints.
CONSTRAINT_PREFIX: Final = "delta.constraints."
_ROW: Final = "__deltaflow_row"


def check_constraints(rows: Any, constraints: Mapping[str, str], *, table: str, node: str) -> None:
    """Blocking: raise for the first of ``rows`` (the Arrow table a batch is staged as, its
    ``DELETE_COLUMN`` included: deletes are not checked) that does not make every constraint
    of ``table`` true (false or null: Delta's rule).

    Raises:
        SchemaError: naming the item, the constraint and its expression.
    """
    import pyarrow as pa
    import pyarrow.compute as pc
    from deltalake import DeltaTable, QueryBuilder, write_deltalake

    data = rows.append_column(_ROW, pa.array(range(rows.num_rows), type=pa.int64()))
    if DELETE_COLUMN in data.column_names:
        data = data.filter(pc.invert(data.column(DELETE_COLUMN)))
    if not data.num_rows:
        return
    data = data.select(
        [c for c in data.column_names if not c.startswith("__deltaflow_") or c == _ROW]
    )
    broken: list[tuple[int, str]] = []
    with tempfile.TemporaryDirectory(prefix="deltaflow-check-") as scratch:
        try:
            write_deltalake(scratch, data)
            query = QueryBuilder().register("batch", DeltaTable(scratch))
            for name, expression in constraints.items():
                found = query.execute(
                    f"SELECT min({_ROW}) AS i FROM batch WHERE ({expression}) IS NOT TRUE"
                ).read_all()
                first = pa.table(found).column(0)[0].as_py()
                if first is not None:
                    broken.append((int(first), name))
        except Exception as exc:  # noqa: BLE001 - an expression DataFusion does not read
            log.debug("table %s: constraints left to the commit (%s)", table, exc)
            return
    if broken:
        item, name = min(broken)
        raise SchemaError(
            f"item #{item} of the batch violated CHECK constraint {name!r} "
            f"({constraints[name]}) of table {table!r}",
            node=node,
            details={"item": item},
        )
