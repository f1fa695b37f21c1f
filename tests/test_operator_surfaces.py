"""What a client writes reaches an operator's log and terminal as text, never as control
(issue #47, findings 7, 8 and 12): a wire value cannot forge a log line; ``table show`` and
``table history`` print any row or ``commitInfo`` literally, escapes visible, and survive
hostile ones; a token file others may read draws a warning, an empty one exits 78 as the docs
say."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import msgpack
import pytest

import deltaflow
from deltaflow.logs import JsonFormatter, TextFormatter, event
from deltaflow.protocol import WS_PATH, encode_frame
from deltaflow.security import read_secret

from .support import StartCluster

ROOT = Path(__file__).resolve().parent.parent
#: A log line an attacker would like written: tabs where the node's format has spaces.
FORGED = "1999-12-31\t23:59:59,999\tWARNING\tdeltaflow.server.node:\tnode\tn1\tdraining"
#: Every kind of character that can end a line or drive a terminal.
CONTROLS = ["\n", "\r", "\t", "\x1b[2J", "\x07", "\x00", "\x7f", "\x85", "\x9b", "\u2028", "\u2029"]
RECORD_START = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ ")


@pytest.fixture
def text_log() -> Iterator[io.StringIO]:
    """deltaflow's INFO logs in the node's text format, as a node writes them to stderr."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger("deltaflow")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield out
    logger.removeHandler(handler)
    logger.setLevel(level)


async def test_wire_values_cannot_forge_a_log_line(
    warehouse: Path, start_cluster: StartCluster, text_log: io.StringIO
) -> None:
    # Finding 7: a refused stream id and the `table` of an opened stream, newline and tabs
    # in them, each wrote the forged WARNING line as a line of its own.
    (node,) = await start_cluster(warehouse, count=1, engine="delta-rs")
    hello = {"t": "hello", "v": [1], "caps": [], "client": "c1", "token": None}
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(f"http://{node.address}{WS_PATH}") as ws,
    ):
        await ws.send_bytes(encode_frame(hello))
        assert msgpack.unpackb(await ws.receive_bytes(timeout=10))["t"] == "welcome"
        opens = [
            ("x\n" + FORGED + "\n\t", "deltaflow.testing.Echo", {}),  # refused: a bad id
            ("s2", "deltaflow.receivers.TableUpsert", {"table": f"t\n{FORGED}\n", "key": ["id"]}),
        ]
        for sid, receiver, args in opens:
            frame = {"t": "open", "sid": sid, "receiver": receiver, "args": args, "key": b"k" * 16}
            await ws.send_bytes(encode_frame(frame))
            answer = msgpack.unpackb(await ws.receive_bytes(timeout=10))
            assert answer["t"] in ("error", "opened"), answer  # logged before it answered
    lines = text_log.getvalue().splitlines()
    assert any("refused client c1" in line for line in lines), lines
    assert any("stream s2 opened" in line for line in lines), lines
    assert [line for line in lines if not RECORD_START.match(line)] == []
    assert [line for line in lines if FORGED in line and "\\t" not in line] == []


def test_every_control_character_is_escaped_in_text_logs_and_json_keeps_the_value(
    text_log: io.StringIO,
) -> None:
    log = logging.getLogger("deltaflow.server.connection")
    for char in CONTROLS:
        value = f"a{char}b"
        event(log, "refusal", f"refused {value}", level=logging.WARNING, stream=value, code="X")
    lines = text_log.getvalue().split("\n")[:-1]
    assert len(lines) == len(CONTROLS) and all(RECORD_START.match(line) for line in lines)
    assert not any(c in line for line in lines for c in "\x1b\x07\x00\x7f\x85\x9b\u2028\u2029")
    # A field's value is a JSON string, read back exactly; a plain one stays as it is.
    for char, line in zip(CONTROLS, lines, strict=True):
        assert json.loads(line.split(" stream=", 1)[1].removesuffix(" code=X")) == f"a{char}b"
    record = logging.LogRecord("deltaflow.x", logging.WARNING, "", 0, "m", None, None)
    record.fields = {"stream": "a\u2028b\x1b", "n": 3}  # type: ignore[attr-defined]
    [line] = JsonFormatter().format(record).splitlines()
    assert "\u2028" not in line and "\x1b" not in line
    assert json.loads(line)["stream"] == "a\u2028b\x1b"


def test_a_traceback_from_the_wire_cannot_pass_for_a_record(text_log: io.StringIO) -> None:
    try:
        raise ValueError(f"bad value x\n{FORGED.replace(chr(9), ' ')}")
    except ValueError:
        logging.getLogger("deltaflow.server.node").exception("batch failed")
    first, *rest = text_log.getvalue().splitlines()
    assert first.endswith("batch failed") and rest
    assert all(line.startswith("    ") for line in rest), rest


def deltaflow_cli(*args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DELTAFLOW_")}
    return subprocess.run(
        [sys.executable, "-m", "deltaflow.cli", *args],
        capture_output=True, text=True, timeout=120, check=False, env=clean,
    )  # fmt: skip


#: Rows a client could write: rich markup, a title, a screen clear, an OSC 8 link, newlines.
HOSTILE_ROWS = [
    "[/bold]",
    "[link=http://evil.example]click[/link]",
    "\x1b]0;owned\x07",
    "\x1b[2J\x1b[H",
    "\x1b]8;;http://evil.example/\x1b\\here\x1b]8;;\x1b\\",
    "a\nb\tc\u2028d\x9b",
]


def test_table_show_prints_any_row_literally(tmp_path: Path) -> None:
    # Finding 8: `[/bold]` crashed `table show` (MarkupError); escapes reached the terminal.
    import pyarrow as pa
    from deltalake import write_deltalake

    warehouse = tmp_path / "wh"
    deltaflow.create_table(warehouse, "t", schema="id:long,name:string", key="id")
    rows = pa.table({
        "id": pa.array(range(len(HOSTILE_ROWS)), pa.int64()),
        "name": HOSTILE_ROWS,
        "_deltaflow_bucket": pa.array([0] * len(HOSTILE_ROWS), pa.int32()),
    })  # fmt: skip
    write_deltalake(str(warehouse / "t"), rows, mode="append")
    done = deltaflow_cli("table", "show", "t", "--warehouse", str(warehouse))
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]", out), repr(out)
    for shown in [
        "[/bold]",
        "[link=http://evil.example]click[/link]",
        r"\x1b]0;owned\x07",
        r"\x1b[2J\x1b[H",
        r"\x1b]8;;http://evil.example/\x1b\here\x1b]8;;\x1b\ ",
        r"a\nb\tc\u2028d\x9b",
    ]:
        assert shown.rstrip() in out, (shown, out)
    # count, settings, last compaction, header, rows
    assert len(out.splitlines()) == 4 + len(HOSTILE_ROWS)


#: commitInfo values any writer can put in a commit file.
HOSTILE_COMMIT_INFOS = [
    {},  # no timestamp, no operation
    {"timestamp": "yesterday", "operation": {"nested": [1, {"deep": None}]}},
    {"timestamp": 10**30, "operationMetrics": {"num_added_rows": "lots"}},
    {"timestamp": 1.5e300, "operation": "W" * 100_000},
    {
        "timestamp": 1_700_000_000_000,
        "operation": "\x1b]0;owned\x07[/bold]",
        "userMetadata": json.dumps(
            {
                "deltaflow": {
                    "node": {"not": "text"},
                    "writers": 5,
                    "lanes": [1, 2],
                    "deleted": [1],
                }
            }
        ),
    },
    {
        "timestamp": 1_700_000_000_000,
        "userMetadata": json.dumps(
            {
                "deltaflow": {
                    "node": "\x1b[2J" * 1000,
                    "lanes": {f"s{i}/0": [1, 0] for i in range(3000)},
                }
            }
        ),
    },
    {"timestamp": 1_700_000_000_000, "userMetadata": "[" * 5000 + "]" * 5000},
]


def test_table_history_survives_any_commit_info(tmp_path: Path) -> None:
    # Finding 8: a hostile commitInfo crashed `table history` (delta-rs's parser, KeyError,
    # AttributeError); now every commit is listed, unknown values as unknown.
    import pyarrow as pa
    from deltalake import write_deltalake

    warehouse = tmp_path / "wh"
    deltaflow.create_table(warehouse, "t", schema="id:long,name:string", key="id")
    rows = pa.table({
        "id": pa.array([1, 2], pa.int64()),
        "name": ["a\u2028b", "c"],  # a value delta-rs writes raw into the commit's stats
        "_deltaflow_bucket": pa.array([0, 0], pa.int32()),
    })  # fmt: skip
    write_deltalake(str(warehouse / "t"), rows, mode="append")
    log = warehouse / "t" / "_delta_log"
    for version, info in enumerate(HOSTILE_COMMIT_INFOS, start=2):
        (log / f"{version:020d}.json").write_text(json.dumps({"commitInfo": info}) + "\n")
    last = 1 + len(HOSTILE_COMMIT_INFOS)
    done = deltaflow_cli("table", "history", "t", "--warehouse", str(warehouse), "--limit", "20")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    firsts = [line.split()[0] for line in lines[1:] if not line.startswith(" ")]  # not folds
    assert firsts == [str(v) for v in range(last, -1, -1)]
    assert "\x1b" not in done.stdout and r"\x1b]0;owned\x07[/bold]" in done.stdout
    assert max(len(line) for line in lines) < 2000  # huge values are cut short
    write = next(line for line in lines if line.startswith("1 "))
    assert " WRITE " in write and " 2 " in write  # its rows, though a value holds U+2028
    as_json = deltaflow_cli("table", "history", "t", "--warehouse", str(warehouse), "--json")
    assert as_json.returncode == 0, as_json.stderr
    commits = json.loads(as_json.stdout)
    assert [c["version"] for c in commits] == list(range(last, -1, -1))
    bare = next(c for c in commits if c["version"] == 2)  # the commit of commitInfo {}
    assert (bare["time"], bare["operation"], bare["writers"]) == (None, None, [])


def test_a_token_file_others_can_read_is_used_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Finding 12: a 0644 token file drew no warning.
    caplog.set_level(logging.WARNING, logger="deltaflow")
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    for mode in (0o644, 0o640, 0o604, 0o600, 0o400):
        token.chmod(mode)
        caplog.clear()
        assert read_secret(token, "token_file") == "s3cret"
        warned = [r.getMessage() for r in caplog.records]
        if mode & 0o077:
            [message] = warned
            assert str(token) in message and f"chmod 600 {token}" in message, message
            assert f"{mode:04o}" in message
        else:
            assert warned == [], (oct(mode), warned)
    # As an operator meets it: at the start of `deltaflow config check` (as of `serve`).
    token.chmod(0o644)
    done = deltaflow_cli(
        "config", "check", "--node-id", "n1", "--warehouse", str(tmp_path / "wh"),
        "--engine", "delta-rs", "--token-file", str(token),
    )  # fmt: skip
    assert f"chmod 600 {token}" in done.stderr, done.stdout + done.stderr


def test_an_empty_token_file_exits_as_the_docs_say(tmp_path: Path) -> None:
    # Finding 12: it exits 78 (a configuration error, as the CLI's exit codes say) where
    # docs/security.md said 2.
    empty = tmp_path / "token"
    empty.write_text("  \n")
    empty.chmod(0o600)
    done = deltaflow_cli(
        "serve", "--node-id", "n1", "--warehouse", str(tmp_path / "wh"), "--engine", "delta-rs",
        "--port", "0", "--token-file", str(empty),
    )  # fmt: skip
    assert f"'{empty}' is empty" in done.stderr, done.stderr
    docs = (ROOT / "docs" / "security.md").read_text(encoding="utf-8")
    said = re.search(r"A token file\s+that is empty.*?exit code (\d+)", docs, re.DOTALL)
    assert said is not None and int(said.group(1)) == done.returncode == 78
    cli = deltaflow_cli("--help").stdout
    assert "78 the configuration is not valid" in " ".join(cli.split())
