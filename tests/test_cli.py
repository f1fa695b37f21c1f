"""The ``deltaflow`` command as an operator meets it: ``--json`` on every command that prints
data, the table as a positional argument with the warehouse from the environment, readable
values, exit 0 after every read (many times over), and errors without tracebacks."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import deltaflow
from deltaflow.server import Node

from .support import Eventually, StartCluster, open_table


def deltaflow_cli(
    *args: str, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_")}
    done = subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", *args],
        capture_output=True, text=True, timeout=120, check=False, env={**clean, **(env or {})},
    )  # fmt: skip
    if check:
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in done.stderr
    return done


def as_json(*args: str, env: dict[str, str] | None = None) -> Any:
    return json.loads(deltaflow_cli(*args, "--json", env=env).stdout)


@pytest.fixture
async def written(tmp_path: Path, start_cluster: StartCluster) -> tuple[Path, list[Node]]:
    """A table ``t`` of 300 rows written by two nodes in two streams, the second updating 100."""
    warehouse = tmp_path / "w"
    nodes = await start_cluster(warehouse, engine="delta-rs")
    async with deltaflow.connect([nodes[0].address]) as client:
        note = "n" * 400  # wide rows: a whole table's JSON overflows a pipe's buffer
        rows = [{"id": i, "v": i * 1.5, "ts": 1.7e9 + i, "note": note} for i in range(300)]
        await client.stream_data(rows, table="t", key="id", stream_id="first")
        updates = [{"id": i, "v": -1.0, "ts": 1.7e9, "note": note} for i in range(100)]
        await client.stream_data(updates, table="t", key="id", stream_id="second")
    return warehouse, nodes


async def test_table_commands_print_json(
    written: tuple[Path, list[Node]], eventually: Eventually
) -> None:
    warehouse, nodes = written
    w = ("--warehouse", str(warehouse))
    shown = await asyncio.to_thread(as_json, "table", "show", "t", *w, "--limit", "5")
    assert shown["table"] == "t"
    assert shown["rows"] == 300
    assert shown["settings"]["key"] == ["id"]
    assert len(shown["sample"]) == 5
    assert all(set(r) == {"id", "v", "ts", "note"} for r in shown["sample"])  # none internal

    history = await asyncio.to_thread(as_json, "table", "history", "t", *w, "--limit", "50")
    versions = [c["version"] for c in history]
    assert versions == sorted(versions, reverse=True)
    assert versions[0] == open_table(warehouse / "t").version()
    first = [c for c in history if "first" in c["streams"]]
    second = [c for c in history if "second" in c["streams"]]
    assert sum(c["rows_added"] - c["rows_removed"] for c in first) == 300
    assert sum(c["rows_added"] - c["rows_removed"] for c in second) == 0  # updates only
    assert {w for c in first + second for w in c["writers"]} == {"node-1", "node-2"}
    assert all(c["node"] in ("node-1", "node-2") for c in first + second)
    assert all(datetime.datetime.fromisoformat(c["time"]).tzinfo for c in history)
    lanes = [lane for c in first for lane in c["lanes"]]
    assert all(lane.startswith("first/") for lane in lanes)
    assert sum(c["streams"]["first"] for c in first) == len(lanes)

    compacted = await asyncio.to_thread(as_json, "table", "optimize", "t", *w)
    assert compacted["files_removed"] > compacted["files_added"] >= 1
    # `table show` says when the table was last compacted: that optimize.
    last = (await asyncio.to_thread(as_json, "table", "show", "t", *w))["last_compaction"]
    assert last["version"] == open_table(warehouse / "t").version()
    assert last["files_removed"] == compacted["files_removed"]
    vacuumed = await asyncio.to_thread(
        as_json, "table", "vacuum", "t", *w, "--dry-run", "--retention-hours", "0"
    )
    assert vacuumed["dry_run"] is True
    assert len(vacuumed["files"]) >= compacted["files_removed"]

    status = await asyncio.to_thread(as_json, "cluster", "status", "--node", nodes[0].address)
    assert {m["node"] for m in status["members"]} == {"node-1", "node-2"}
    drained = await asyncio.to_thread(as_json, "node", "drain", "--node", nodes[1].address)
    assert drained["node"] == "node-2"
    assert drained["stopped"] is True
    assert drained["partitions"] == {"node-1": 64}
    # It left on purpose: shown as left, not dead, once it stopped answering.
    membership = nodes[0]._membership
    assert membership is not None

    def state_of_node_2() -> str:
        return next(str(m["state"]) for m in membership.members() if m["node"] == "node-2")

    await eventually(lambda: state_of_node_2() == "left", "node-2 shown as left")
    text = await asyncio.to_thread(deltaflow_cli, "cluster", "status", "--node", nodes[0].address)
    assert "LEFT" in text.stdout and "DEAD" not in text.stdout


async def test_the_table_is_positional_and_the_warehouse_comes_from_the_environment(
    written: tuple[Path, list[Node]], tmp_path: Path
) -> None:
    warehouse, _ = written
    env = {"DELTAFLOW_WAREHOUSE": str(warehouse)}
    text = (await asyncio.to_thread(deltaflow_cli, "table", "show", "t", env=env)).stdout
    lines = text.splitlines()
    assert lines[0] == "table t: 300 rows"
    assert lines[2] == "last compacted: not in its last 1,000 versions"
    assert lines[3].split() == ["id", "v", "ts", "note"]  # internal columns hidden
    assert "1700000000" in text and "1.7E9" not in text.upper()
    every = await asyncio.to_thread(deltaflow_cli, "table", "show", "t", "--all-columns", env=env)
    assert "_deltaflow_bucket" in every.stdout
    config = tmp_path / "node.toml"
    config.write_text(f'node_id = "n"\nwarehouse = "{warehouse}"\n')
    history = await asyncio.to_thread(
        deltaflow_cli, "table", "history", "t", env={"DELTAFLOW_CONFIG": str(config)}
    )
    header = history.stdout.splitlines()[0].split()
    assert header == ["VERSION", "TIME", "OPERATION", "NODE", "WRITERS", "+ROWS", "-ROWS",
                      "STREAMS"]  # fmt: skip
    assert "first (" in history.stdout and "node-" in history.stdout
    nowhere = await asyncio.to_thread(deltaflow_cli, "table", "show", "t", check=False)
    assert nowhere.returncode == 2
    assert "no warehouse: pass --warehouse" in nowhere.stderr


async def test_reading_a_table_exits_0_every_time(written: tuple[Path, list[Node]]) -> None:
    """delta-rs and Arrow threads must never abort the exit after the rows are printed."""
    warehouse, _ = written
    env = {"DELTAFLOW_WAREHOUSE": str(warehouse)}
    runs = [("table", "show", "t"), ("table", "history", "t"), ("table", "show", "t", "--json")]
    done = await asyncio.gather(
        *(asyncio.to_thread(deltaflow_cli, *args, env=env, check=False) for args in runs * 4)
    )
    assert [d.returncode for d in done] == [0] * len(done), [d.stderr[-300:] for d in done]


def test_leaving_survives_a_table_read_abandoned_mid_scan(tmp_path: Path) -> None:
    """The cause of the aborted exits: a deltalake table read as a pyarrow dataset and left
    before its end keeps Arrow's I/O threads in delta-rs's file system while the interpreter
    tears down (exit 134 in most runs without it). ``leave`` exits past that teardown."""
    import deltalake
    import pyarrow as pa

    deltalake.write_deltalake(
        str(tmp_path / "big"), pa.table({"id": range(1_000_000), "s": ["x" * 20] * 1_000_000})
    )
    script = (
        "from deltalake import DeltaTable\n"
        "from deltaflow.cli_output import leave\n"
        f"print(DeltaTable({str(tmp_path / 'big')!r}).to_pyarrow_dataset().head(5).num_rows)\n"
        "leave(0)\n"
    )
    codes = []
    for _ in range(8):
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
        )
        assert run.stdout.strip() == "5"
        codes.append(run.returncode)
    assert codes == [0] * 8


def test_errors_an_operator_meets_first_have_no_traceback(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        served = deltaflow_cli(
            "serve", "--node-id", "n1", "--port", str(port), "--engine", "delta-rs",
            "--warehouse", str(tmp_path / "w"), check=False,
        )  # fmt: skip
    assert served.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in served.stderr
    assert "Traceback" not in served.stderr
    missing = deltaflow_cli(
        "serve", "--node-id", "n1", "--warehouse", str(tmp_path / "w"), "--engine", "delta-rs",
        "--token-file", str(tmp_path / "no-such-token"), check=False,
    )  # fmt: skip
    assert missing.returncode == 78
    assert f"--token-file '{tmp_path / 'no-such-token'}' cannot be read" in missing.stderr
    assert "Traceback" not in missing.stderr


async def test_a_closed_pipe_ends_the_command_quietly(written: tuple[Path, list[Node]]) -> None:
    warehouse, _ = written
    command = (
        f"{sys.executable} -m deltaflow.cli table show t --warehouse {warehouse} --json "
        "--limit 300 | head -c 20"
    )
    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-o", "pipefail", "-c", command],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert len(done.stdout) == 20


def test_jars_lists_the_cached_jars_as_json() -> None:
    """``deltaflow jars --json``: the jar cache's files (fetched once by the setup)."""
    env = {"DELTAFLOW_JARS_DIR": os.environ.get("DELTAFLOW_JARS_DIR", "")}
    done = deltaflow_cli("jars", "--json", env={k: v for k, v in env.items() if v})
    jars = json.loads(done.stdout)
    assert jars and all(Path(j).is_file() and j.endswith(".jar") for j in jars)
    assert any("delta-spark" in Path(j).name for j in jars)
