"""CDC benchmark: an out-of-order change feed into a ``sequence_by`` table, against one bulk
MERGE of the whole feed with the sequence predicate.

The feed (:mod:`deltaflow.testing.changes`): ``--changes`` changes (default 1,000,000) over
``--keys`` rows (100,000) of a source database, 1% deletes, split among ``--producers`` (3)
that each deliver their share with 10% of it late. Every variant runs in its own subprocess
and its table is checked against the rows the source ends with (read with ``deltalake``)::

    .venv/bin/python bench/cdc.py                          # every variant
    .venv/bin/python bench/cdc.py --changes 200000 --keys 20000 --variants bulk-delta-rs

Results go to ``bench/out/cdc.json``; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

OUT_DIR: Final = Path(__file__).resolve().parent / "out"
SCHEMA: Final = "id:long,lsn:long,name:string,amount:long"
COLUMNS: Final = ("id", "lsn", "name", "amount")
#: Rows per Arrow page a producer sends (the form the bulk MERGEs get their rows in).
PAGE_ROWS: Final = 10_000
#: Client window: 4,000-row pages, 16 batches in flight per node, 2 per partition (as the
#: ingest bench's Arrow variants).
PAGE_SIZE: Final = 4000
WINDOW_PER_NODE: Final = 16


@dataclass(frozen=True, slots=True)
class Result:
    variant: str
    changes: int
    seconds: float
    changes_per_s: float
    commits: int = 0
    superseded: int = 0
    check: str = ""
    note: str = ""


def feed(changes: int, keys: int, producers: int) -> tuple[Any, list[list[Any]]]:
    """The deterministic feed and each producer's share, in arrival order."""
    from deltaflow.testing.changes import change_feed

    history = change_feed(keys, changes, deletes=0.01, seed=7)
    return history, history.arrivals(producers, late=0.1, seed=8)


def pages(changes: list[Any]) -> list[Any]:
    """A share as Arrow pages with an ``op`` column."""
    import pyarrow as pa

    return [
        pa.Table.from_pylist([c.as_flat() for c in changes[i : i + PAGE_ROWS]])
        for i in range(0, len(changes), PAGE_ROWS)
    ]


def bulk_source(history: Any) -> Any:
    """The whole feed as one Arrow table, the newest change per key kept (deletes flagged):
    what one bulk MERGE takes."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from deltaflow.tables.sequence import newest_per_key

    table = pa.Table.from_pylist([c.as_flat() for c in history.changes])
    newest = newest_per_key(table, ["id"], ["lsn"])
    return newest.append_column("is_delete", pc.equal(newest.column("op"), "d")).drop_columns(
        ["op"]
    )


# -- variants (each in a child process) ------------------------------------------------------


def run_bulk_spark(warehouse: Path, history: Any, _shares: Any, _nodes: int) -> Result:
    """One Spark MERGE of the feed (newest change per key) with the sequence predicate, into
    an empty table; the JVM warmed up first by two untimed MERGEs."""
    import pyarrow.parquet as pq

    from deltaflow.spark_integration import SparkConfig, get_spark

    spark = get_spark(SparkConfig(master="local[*]"))
    path = warehouse / "bulk_spark"

    def create(target: Path) -> None:
        spark.sql(
            f"CREATE TABLE delta.`{target}` (id BIGINT, lsn BIGINT, name STRING, amount BIGINT) "
            "USING DELTA"
        )

    def merge(target: Path, staged: Path) -> None:
        cols = ", ".join(COLUMNS)
        spark.sql(
            f"MERGE INTO delta.`{target}` AS t USING parquet.`{staged}` AS s ON t.id = s.id "
            "WHEN MATCHED AND s.is_delete AND s.lsn > t.lsn THEN DELETE "
            "WHEN MATCHED AND s.lsn > t.lsn THEN UPDATE SET "
            + ", ".join(f"t.{c} = s.{c}" for c in COLUMNS)
            + f" WHEN NOT MATCHED AND NOT s.is_delete THEN INSERT ({cols}) "
            f"VALUES ({', '.join(f's.{c}' for c in COLUMNS)})"
        )

    staging = warehouse / ".staging"
    staging.mkdir(parents=True)
    warm = bulk_source(type(history)(history.changes[:50_000]))
    for i in range(2):  # untimed: a fresh JVM's first MERGEs pay for class loading and JIT
        target = warehouse / f"warmup{i}"
        create(target)
        pq.write_table(warm, staging / f"warm{i}.parquet")
        merge(target, staging / f"warm{i}.parquet")
    create(path)
    started = time.monotonic()
    source = bulk_source(history)
    staged = staging / f"{uuid.uuid4().hex}.parquet"
    pq.write_table(source, staged)
    merge(path, staged)
    seconds = time.monotonic() - started
    return Result("bulk-spark", len(history.changes), seconds, len(history.changes) / seconds, 1)


def run_bulk_deltars(warehouse: Path, history: Any, _shares: Any, _nodes: int) -> Result:
    """One delta-rs MERGE of the feed (newest change per key) with the sequence predicate."""
    import pyarrow as pa
    from deltalake import DeltaTable, write_deltalake

    path = str(warehouse / "bulk_delta_rs")
    schema = pa.schema([("id", pa.int64()), ("lsn", pa.int64()), ("name", pa.string()),
                        ("amount", pa.int64())])  # fmt: skip
    write_deltalake(path, schema.empty_table(), mode="append")
    started = time.monotonic()
    source = bulk_source(history)
    values = {c: f"s.{c}" for c in COLUMNS}
    (
        DeltaTable(path)
        .merge(source, predicate="t.id = s.id", source_alias="s", target_alias="t")
        .when_matched_delete(predicate="s.is_delete AND s.lsn > t.lsn")
        .when_matched_update(updates=values, predicate="s.lsn > t.lsn")
        .when_not_matched_insert(updates=values, predicate="NOT s.is_delete")
        .execute()
    )
    seconds = time.monotonic() - started
    n = len(history.changes)
    return Result("bulk-delta-rs", n, seconds, n / seconds, 1)


def run_deltaflow(
    warehouse: Path, history: Any, shares: list[list[Any]], nodes: int, *, engine: str,
    sequence: bool, scd2: bool = False, merge: str = "last",
) -> Result:  # fmt: skip
    """Node processes; the producers stream their shares at once as Arrow pages with an
    operation column (``Changelog(op="op")``); without ``sequence`` the table has no
    ``sequence_by`` (plain upserts, in arrival order: the cost of ordering); with ``scd2`` it
    keeps every version (``history="scd2"``: the cost of history); with ``merge="partial"``
    its columns carry their own sequences (the cost of merging column by column)."""
    import deltaflow
    from deltaflow.testing import NodeProcess, free_port, wait_for_members

    table = "scd2" if scd2 else merge if merge != "last" else "cdc" if sequence else "plain"
    deltaflow.create_table(
        warehouse, table, schema=SCHEMA, key="id", sequence_by="lsn" if sequence else (),
        history="scd2" if scd2 else "none", merge=merge,
    )  # fmt: skip
    sent = [pages(share) for share in shares]

    async def main() -> Result:
        ports = [free_port() for _ in range(nodes)]
        addresses = [f"127.0.0.1:{p}" for p in ports]
        procs = [
            NodeProcess(f"node-{i}", warehouse, port=port,
                        peers=[a for a in addresses if not a.endswith(f":{port}")],
                        extra=["--engine", engine])
            for i, port in enumerate(ports, start=1)
        ]  # fmt: skip
        await asyncio.gather(*(p.start() for p in procs))
        try:
            await wait_for_members(addresses)
            options = deltaflow.StreamerOptions(
                page_size=PAGE_SIZE,
                max_in_flight=WINDOW_PER_NODE * nodes,
                per_partition_in_flight=2,
            )
            async with deltaflow.connect(addresses) as client:
                # Untimed: the nodes' first commits (a JVM's warm-up) on another table.
                await client.stream_data(
                    pages(history.changes[:20_000]), table="warmup", key="id",
                    changelog=deltaflow.Changelog(op="op"), options=options,
                )  # fmt: skip
                before = await _counts(addresses)
                started = time.monotonic()
                summaries = await asyncio.gather(
                    *(
                        client.stream_data(
                            share,
                            table=table,
                            key="id",
                            options=options,
                            changelog=deltaflow.Changelog(op="op"),
                        )
                        for share in sent
                    )
                )
                seconds = time.monotonic() - started
            after = await _counts(addresses)
        finally:
            for proc in reversed(procs):
                await proc.stop()
        n = sum(s.items_acked for s in summaries)
        kind = "-scd2" if scd2 else f"-{merge}" if merge != "last" else ""
        name = f"deltaflow-{engine}" + (kind if sequence else "-plain")
        return Result(
            name,
            n,
            seconds,
            n / seconds,
            int(after["deltaflow_commits_total"] - before["deltaflow_commits_total"]),
            int(
                after["deltaflow_changes_superseded_total"]
                - before["deltaflow_changes_superseded_total"]
            ),
            note=f"{nodes} node process(es), {len(shares)} producers",
        )

    return asyncio.run(main())


async def _counts(addresses: list[str]) -> dict[str, float]:
    """Counters summed over the nodes' ``/metrics``."""
    import aiohttp
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for address in addresses:
            async with session.get(f"http://{address}/metrics") as answer:
                text = await answer.text()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if not sample.labels.keys() - {"node"}:
                        out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


VARIANTS: Final = {
    "bulk-spark": run_bulk_spark,
    "bulk-delta-rs": run_bulk_deltars,
    "deltaflow-spark": lambda w, h, s, n: run_deltaflow(w, h, s, n, engine="spark", sequence=True),
    "deltaflow-delta-rs": lambda w, h, s, n: run_deltaflow(
        w, h, s, n, engine="delta-rs", sequence=True
    ),
    "deltaflow-spark-plain": lambda w, h, s, n: run_deltaflow(
        w, h, s, n, engine="spark", sequence=False
    ),
    "deltaflow-delta-rs-plain": lambda w, h, s, n: run_deltaflow(
        w, h, s, n, engine="delta-rs", sequence=False
    ),
    "deltaflow-delta-rs-scd2": lambda w, h, s, n: run_deltaflow(
        w, h, s, n, engine="delta-rs", sequence=True, scd2=True
    ),
    "deltaflow-delta-rs-partial": lambda w, h, s, n: run_deltaflow(
        w, h, s, n, engine="delta-rs", sequence=True, merge="partial"
    ),
}
TABLES: Final = {
    "bulk-spark": "bulk_spark",
    "bulk-delta-rs": "bulk_delta_rs",
    "deltaflow-spark": "cdc",
    "deltaflow-delta-rs": "cdc",
    "deltaflow-spark-plain": "plain",
    "deltaflow-delta-rs-plain": "plain",
    "deltaflow-delta-rs-scd2": "scd2",
    "deltaflow-delta-rs-partial": "partial",
}


def check(path: Path, history: Any) -> str:
    """Whether the table holds exactly the rows the source database ends with."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    reader = QueryBuilder().register("t", DeltaTable(str(path))).execute("SELECT * FROM t")
    rows = pa.table(reader.read_all()).to_pylist()
    if rows and "__end_at" in rows[0]:  # a history: its current versions, and one per change
        versions = len(rows)
        changes = sum(c.op != "d" for c in history.changes)
        if versions != changes:
            return f"{versions:,} versions for {changes:,} changes"
        rows = [r for r in rows if r["__end_at"] is None]
    table = {r["id"]: tuple(r[c] for c in COLUMNS) for r in rows}
    want = {k: tuple(r[c] for c in COLUMNS) for k, r in history.final().items()}
    if len(table) != len(rows):
        return f"MISMATCH ({len(rows) - len(table)} duplicate keys)"
    wrong = sum(table.get(k) != v for k, v in want.items()) + len(table.keys() - want.keys())
    return "OK" if not wrong else f"{wrong:,} of {len(want):,} keys differ"


def child(args: argparse.Namespace) -> None:
    history, shares = feed(args.changes, args.keys, args.producers)
    warehouse = Path(args.warehouse)
    result = VARIANTS[args.variant](warehouse, history, shares, args.nodes)
    verdict = check(warehouse / TABLES[args.variant], history)
    if args.variant.endswith("-plain"):  # arrival order: expected to differ
        verdict = f"arrival order: {verdict}"
    Path(args.out).write_text(json.dumps(asdict(result) | {"check": verdict}))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--changes", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--nodes", type=int, default=2, help="node processes of deltaflow")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--variant", help=argparse.SUPPRESS)
    parser.add_argument("--warehouse", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        child(args)
        return 0
    names = args.variants.split(",")
    unknown = set(names) - VARIANTS.keys()
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; known: {list(VARIANTS)}")
    scratch = Path(tempfile.mkdtemp(prefix="deltaflow-cdc-bench-"))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"deltaflow CDC benchmark: {args.changes:,} changes over {args.keys:,} keys, 1% "
          f"deletes, {args.producers} producers with 10% late; {os.cpu_count()} cores, load "
          f"{load}", flush=True)  # fmt: skip
    results: list[Result] = []
    try:
        for name in names:
            out = scratch / f"{name}.json"
            print(f"running {name} ... ", end="", flush=True)
            done = subprocess.run(
                [sys.executable, __file__, "--variant", name, "--warehouse",
                 str(scratch / name), "--out", str(out), "--changes", str(args.changes),
                 "--keys", str(args.keys), "--producers", str(args.producers),
                 "--nodes", str(args.nodes)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if done.returncode != 0:
                print(f"FAILED:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
                continue
            result = Result(**json.loads(out.read_text()))
            results.append(result)
            print(f"{result.seconds:.2f}s, {result.changes_per_s:,.0f} changes/s, {result.check}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    by = {r.variant: r for r in results}
    header = f"{'variant':<26}{'changes/s':>12}{'seconds':>9}{'commits':>9}{'superseded':>12}"
    print(f"\n{header}  check")
    for r in results:
        print(f"{r.variant:<26}{r.changes_per_s:>12,.0f}{r.seconds:>9.2f}{r.commits:>9}"
              f"{r.superseded:>12,}  {r.check}")  # fmt: skip
    for ours, base, goal in [
        ("deltaflow-spark", "bulk-spark", 0.7),
        ("deltaflow-delta-rs", "bulk-delta-rs", 0.5),
        ("deltaflow-spark", "deltaflow-spark-plain", None),
        ("deltaflow-delta-rs", "deltaflow-delta-rs-plain", None),
        ("deltaflow-delta-rs-scd2", "deltaflow-delta-rs", None),
    ]:
        if ours in by and base in by:
            ratio = by[ours].changes_per_s / by[base].changes_per_s
            aim = f" (goal >= {goal}x)" if goal else ""
            print(f"{ours} / {base}: {ratio:.2f}x{aim}")
    OUT_DIR.mkdir(exist_ok=True)
    (OUT_DIR / "cdc.json").write_text(json.dumps([asdict(r) for r in results], indent=2))
    return 0 if results and all(r.check == "OK" or "arrival" in r.check for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
