"""What each table a node writes costs it (issue 47, finding 9): its RSS, and the size of
the answer its peers' polls get (a peer reads at most 8 MiB of it) and of ``/v1/cluster``;
and, on a tree with ``max_tables``, that a stream to one table more is refused while the
node's tables go on.

The node is ``deltaflow serve --engine delta-rs`` from the tree given by ``--tree``, as in
``bench/attacks.py`` (whose node and bench it uses); the client that writes the tables and
the peer that polls the node run from the same tree, each in a process of its own.

    .venv/bin/python bench/tables.py --tree /work/baseline --json before.json
    .venv/bin/python bench/tables.py --json after.json          # this checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attacks import Bench, Node, NodeExited, bearer, http, table

#: Table names of this many characters (128 at most): the ``tables`` part of an answer holds them.
NAME_LENGTH = 120

#: Writes tables ``first`` .. ``first + count - 1`` (names of ``NAME_LENGTH`` characters),
#: a row each, with the tree's client; prints a JSON list of the errors (null: written).
WRITER = """
import asyncio, json, sys
import deltaflow

async def main(address, token, first, count, length):
    errors = []
    async with deltaflow.connect([address], token=token) as client:
        for i in range(first, first + count):
            name = f"t{i:06d}_".ljust(length, "x")
            try:
                await client.stream_data([{"id": 1, "v": i}], table=name, key="id")
                errors.append(None)
            except deltaflow.DataStreamerError as exc:
                errors.append(exc.failures[0].reason if exc.failures else str(exc))
    print(json.dumps(errors))

asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])))
"""

#: One peer poll of the node, proven with the peer token (if the tree has one) by the tree's
#: own peer client; prints the answer's status, its size in bytes and its tables.
POLLER = """
import asyncio, json, sys
from deltaflow.server.peers import PeerClient

async def main(address, secret, warehouse):
    signed = {}
    try:  # a tree whose nodes prove who they are: poll as a node whose key is published
        from deltaflow.server.identity import NodeKey
    except ImportError:
        pass
    else:
        key = NodeKey("bench-peer")
        key.publish(warehouse)
        signed = {"signer": key}
    async with PeerClient(node_id="bench-peer", address="127.0.0.1:9", secret=secret or None,
                          tls=None, timeout=30, **signed) as peer:
        reply = await peer.call(address, "poll")
    tables = reply.body.get("tables")
    print(json.dumps({"status": reply.status, "bytes": len(json.dumps(reply.body)),
                      "tables": None if tables is None else len(tables)}))

asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
"""


async def run_script(bench: Bench, script: str, *args: str, timeout: float = 600) -> Any:
    """``script`` run by the tree's interpreter and deltaflow; the JSON it printed."""
    proc = await asyncio.create_subprocess_exec(
        bench.python, "-c", script, *args,
        env=bench.env, cwd=bench.work,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(timeout):
        out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {err.decode()[-400:]}")
    return json.loads(out.decode().strip().splitlines()[-1])


async def write_tables(bench: Bench, node: Node, first: int, count: int) -> list[str | None]:
    return list(
        await run_script(
            bench, WRITER, node.address, bench.token, str(first), str(count), str(NAME_LENGTH)
        )
    )


async def sizes(bench: Bench, node: Node) -> dict[str, Any]:
    """The node's RSS (KiB), its poll answer and its ``/v1/cluster`` answer (bytes)."""
    try:
        poll = await run_script(
            bench, POLLER, node.address, bench.peer_token or "", str(node.warehouse), timeout=60
        )
    except (RuntimeError, TimeoutError) as exc:
        poll = {"status": 0, "bytes": None, "tables": None, "error": str(exc)[-200:]}
    status, body = await http(
        "GET", f"http://{node.address}/v1/cluster", headers=bearer(bench.token)
    )
    cluster = len(json.dumps(body)) if status == 200 else None
    await asyncio.sleep(0.5)  # the committers' last allocations settle
    return {"rss_kib": node.memory()["VmRSS"], "poll": poll, "cluster_bytes": cluster}


def per_table(before: Any, after: Any, count: int) -> str:
    if before is None or after is None:
        return "?"
    return f"{(after - before) / count:,.0f}"


async def cost_per_table(bench: Bench, count: int) -> None:
    """RSS and answer sizes after one table, then after ``count`` more."""
    async with bench.node("n1", token_file=bench.token_file, partitions=8) as node:
        failed = [e for e in await write_tables(bench, node, 0, 1) if e]
        first = await sizes(bench, node)
        started = time.monotonic()
        failed += [e for e in await write_tables(bench, node, 1, count) if e]
        seconds = time.monotonic() - started
        last = await sizes(bench, node)
    bench.add("9", "tables written", f"{1 + count} in {seconds:.0f} s", f"{len(failed)} refused")
    bench.add(
        "9",
        "RSS per table",
        f"{per_table(first['rss_kib'], last['rss_kib'], count)} KiB "
        f"({first['rss_kib'] / 1024:.0f} -> {last['rss_kib'] / 1024:.0f} MB)",
        "measured",
    )
    poll_first, poll_last = first["poll"]["bytes"], last["poll"]["bytes"]
    grows = per_table(poll_first, poll_last, count)
    tables_at = (
        "?"
        if grows == "?" or float(grows.replace(",", "")) <= 0
        else f"{(8 * 2**20 - poll_last) / float(grows.replace(',', '')) + 1 + count:,.0f}"
    )
    bench.add(
        "9",
        "poll answer per table",
        f"{grows} B ({poll_first} -> {poll_last} B; tables listed: {last['poll']['tables']})",
        "grows: past 8 MiB at about " + tables_at + " tables" if tables_at != "?" else "flat",
    )
    if "error" in last["poll"]:
        bench.add("9", "poll failed", last["poll"]["error"], "error")
    bench.add(
        "9",
        "/v1/cluster per table",
        f"{per_table(first['cluster_bytes'], last['cluster_bytes'], count)} B "
        f"({first['cluster_bytes']} -> {last['cluster_bytes']} B)",
        "measured",
    )


async def past_the_cap(bench: Bench, cap: int) -> None:
    """A node with ``--max-tables cap``: the table past it is refused, the first still
    written."""
    node = Node(bench, "n2", token_file=bench.token_file, partitions=8)
    node._args += ["--max-tables", str(cap)]  # the bench's own node: one flag more
    try:
        await node.start()
    except NodeExited:  # a tree without the setting
        bench.add("9", f"--max-tables {cap}", "the node does not start", "no such setting")
        return
    try:
        errors = await write_tables(bench, node, 0, cap + 1)
        again = await write_tables(bench, node, 0, 1)
    finally:
        await node.stop()
    written = sum(e is None for e in errors)
    refused = errors[-1]
    bench.add(
        "9",
        f"--max-tables {cap}, {cap + 1} tables",
        f"{written} written; the last: {refused}" if refused else f"{written} written",
        "refused" if refused else "not refused",
    )
    bench.add("9", "a table under the cap, written again", again[0] or "written", "ok")


async def main_async(bench: Bench, count: int, cap: int) -> None:
    await cost_per_table(bench, count)
    await past_the_cap(bench, cap)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--tree",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="the deltaflow checkout the node runs (default: this one)",
    )
    parser.add_argument("--python", default=sys.executable, help="the nodes' interpreter")
    parser.add_argument("--tables", type=int, default=400, help="tables to write (%(default)s)")
    parser.add_argument("--cap", type=int, default=20, help="--max-tables to try (%(default)s)")
    parser.add_argument("--json", type=Path, help="also write the rows here, as JSON")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="deltaflow-tables-"))
    bench = Bench(args.tree.resolve(), args.python, work, {})
    where = bench.detect()
    print(f"tree {bench.tree} (deltaflow from {where}); work {work}", flush=True)
    try:
        asyncio.run(main_async(bench, args.tables, args.cap))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("\n".join(table(bench.rows)))
    if args.json is not None:
        report = {"tree": str(bench.tree), "rows": [asdict(r) for r in bench.rows]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
