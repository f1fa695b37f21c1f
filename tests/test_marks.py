"""Lane marks: which batches a table already holds, read from its Delta log as a node reads it
before each commit (``tables/marks.py``). The logs here are written by hand, one
action per line as Delta writes them, so every case is exact and no engine runs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deltaflow.tables.checkpoints import checkpoint_vectors
from deltaflow.tables.marks import LaneMarks, Mark, commit_vectors


def commit(
    table: Path,
    version: int,
    *actions: dict[str, Any],
    lanes: dict[str, Mark] | None = None,
    node: str = "n1",
    timestamp: int = 0,
) -> Path:
    """Write commit ``version`` of ``table``: a commitInfo recording ``lanes`` (as a node
    writes it), then ``actions``."""
    log = table / "_delta_log"
    log.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"timestamp": timestamp, "operation": "WRITE"}
    if lanes is not None:
        info["userMetadata"] = LaneMarks.user_metadata(node, lanes)
    lines = [json.dumps({"commitInfo": info}), *(json.dumps(a) for a in actions)]
    path = log / f"{version:020d}.json"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def dv(name: str, offset: int | None = 1) -> dict[str, Any]:
    """A deletion vector descriptor (stored in a file, at ``offset``)."""
    descriptor: dict[str, Any] = {
        "storageType": "u",
        "pathOrInlineDv": name,
        "sizeInBytes": 34,
        "cardinality": 2,
    }
    if offset is not None:
        descriptor["offset"] = offset
    return descriptor


def add(path: str, vector: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"add": {"path": path, "size": 1, "dataChange": True, "deletionVector": vector}}


def remove(path: str, vector: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"remove": {"path": path, "dataChange": True, "deletionVector": vector}}


def test_a_batch_counts_as_applied_once_its_mark_or_a_later_one_is_committed(
    tmp_path: Path,
) -> None:
    commit(tmp_path, 0, lanes={"s/0": (4, 1), "s/1": (0, 0)})
    marks = LaneMarks(tmp_path)
    assert not marks.applied("s/0", (4, 1)), "nothing counts as applied before the log is read"
    assert marks.refresh() is False
    assert marks.scanned == 0
    # The same batch's earlier writes and every earlier batch are in the table.
    assert marks.applied("s/0", (4, 1)) and marks.applied("s/0", (4, 0))
    assert marks.applied("s/0", (3, 7))
    # Its later writes, later batches, other lanes and other streams are not.
    assert not marks.applied("s/0", (4, 2))
    assert not marks.applied("s/0", (5, 0))
    assert marks.applied("s/1", (0, 0)) and not marks.applied("s/1", (1, 0))
    assert not marks.applied("s/2", (0, 0))
    assert not marks.applied("other/0", (0, 0))


def test_the_highest_mark_of_a_lane_wins_whatever_order_commits_come_in(tmp_path: Path) -> None:
    commit(tmp_path, 0, lanes={"s/0": (2, 0)})
    commit(tmp_path, 1, lanes={"s/0": (9, 0), "s/1": (1, 0)})
    commit(tmp_path, 2, lanes={"s/0": (5, 3)})  # another stream's commit may lag behind
    commit(tmp_path, 10, lanes={"s/1": (0, 4)})
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.scanned == 10
    assert marks.applied("s/0", (9, 0)) and not marks.applied("s/0", (9, 1))
    assert marks.applied("s/1", (1, 0)) and not marks.applied("s/1", (1, 1))
    marks.absorb({"s/0": (3, 0), "s/1": (2, 0), "s/2": (0, 0)})
    assert marks.applied("s/0", (9, 0)), "absorbing an older mark lowered the lane's"
    assert marks.applied("s/1", (2, 0)) and marks.applied("s/2", (0, 0))


def test_refresh_reads_only_the_commits_written_since_the_last_one(tmp_path: Path) -> None:
    marks = LaneMarks(tmp_path)
    assert marks.refresh() is False, "a table without a log has nothing to read"
    assert marks.scanned == -1
    commit(tmp_path, 0, lanes={"s/0": (0, 0)})
    marks.refresh()
    # A commit file another process rewrote after it was read is not read again.
    commit(tmp_path, 0, lanes={"s/0": (7, 0)})
    commit(tmp_path, 1, lanes={"s/1": (1, 0)})
    (tmp_path / "_delta_log" / "00000000000000000002.crc").write_text("{}")
    (tmp_path / "_delta_log" / "_last_checkpoint").write_text("{}")
    marks.refresh()
    assert marks.scanned == 1
    assert marks.applied("s/1", (1, 0))
    assert not marks.applied("s/0", (1, 0)), "version 0 was read twice"


def test_refresh_says_whether_a_new_commit_changed_metadata_or_protocol(tmp_path: Path) -> None:
    marks = LaneMarks(tmp_path)
    commit(tmp_path, 0, {"protocol": {"minReaderVersion": 1}}, lanes={"s/0": (0, 0)})
    assert marks.refresh() is True
    commit(tmp_path, 1, add("a.parquet"), lanes={"s/0": (1, 0)})
    assert marks.refresh() is False, "a data commit does not change the table's metadata"
    commit(tmp_path, 2, {"metaData": {"id": "x"}})
    commit(tmp_path, 3, add("b.parquet"))
    assert marks.refresh() is True, "a metaData action before the last new commit was missed"
    assert marks.refresh() is False, "nothing new"


def test_marks_a_commit_holds_as_a_top_level_field_are_read_too(tmp_path: Path) -> None:
    log = tmp_path / "_delta_log"
    log.mkdir()
    info = {"commitInfo": {"deltaflow": {"node": "n1", "lanes": {"s/0": [3, 2]}}}}
    (log / f"{0:020d}.json").write_text(json.dumps(info) + "\n")
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.applied("s/0", (3, 2)) and not marks.applied("s/0", (3, 3))


@pytest.mark.parametrize(
    "info",
    [
        {"userMetadata": "written by someone else"},
        {"userMetadata": '"deltaflow" but not json'},
        {"userMetadata": '["deltaflow"]'},
        {"userMetadata": '{"deltaflow": "lanes"}'},
        {"userMetadata": '{"deltaflow": {"lanes": [1, 2]}}'},
        {"userMetadata": 7, "deltaflow": "not a map"},
        {"deltaflow": {"lanes": "s/0"}},
        {},
    ],
)
def test_commits_of_other_writers_hold_no_marks(tmp_path: Path, info: dict[str, Any]) -> None:
    log = tmp_path / "_delta_log"
    log.mkdir()
    (log / f"{0:020d}.json").write_text(json.dumps({"commitInfo": info}) + "\n")
    marks = LaneMarks(tmp_path)
    assert marks.refresh() is False
    assert marks.scanned == 0
    assert not marks.applied("s/0", (0, 0))


def test_only_well_formed_marks_are_taken(tmp_path: Path) -> None:
    lanes = {"s/0": [1, 2], "s/1": [1], "s/2": [1, 2, 3], "s/3": ["1", 2], "s/4": [1, "2"]}
    meta = json.dumps({"deltaflow": {"node": "n1", "lanes": lanes}})
    log = tmp_path / "_delta_log"
    log.mkdir()
    (log / f"{0:020d}.json").write_text(json.dumps({"commitInfo": {"userMetadata": meta}}))
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.applied("s/0", (1, 2))
    assert [lane for lane in ("s/1", "s/2", "s/3", "s/4") if marks.applied(lane, (0, 0))] == []


def test_an_unreadable_commit_is_logged_and_holds_no_marks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log = tmp_path / "_delta_log"
    log.mkdir()
    broken = log / f"{0:020d}.json"
    broken.write_text('{"commitInfo": {"userMetadata": "{\\"deltaflow\\"\n')
    commit(tmp_path, 1, lanes={"s/0": (1, 0)})
    marks = LaneMarks(tmp_path)
    with caplog.at_level(logging.WARNING, logger="deltaflow.tables.marks"):
        marks.refresh()
    assert marks.scanned == 1
    assert marks.applied("s/0", (1, 0))
    [record] = caplog.records
    assert isinstance(record.args, tuple) and isinstance(record.args[1], ValueError)
    assert record.getMessage() == f"cannot read lane marks from {broken}: {record.args[1]}"


def test_a_commit_that_cannot_be_read_is_read_next_time_not_skipped(tmp_path: Path) -> None:
    # A store that fails a read (or a file in the way) must not make a batch applied in that
    # commit look new: the refresh stops before it, and the next one reads it.
    commit(tmp_path, 0, lanes={"s/0": (1, 0)})
    in_the_way = tmp_path / "_delta_log" / f"{1:020d}.json"
    in_the_way.mkdir()  # read_text fails: IsADirectoryError
    marks = LaneMarks(tmp_path)
    with pytest.raises(OSError):
        marks.refresh()
    assert marks.scanned == 0 and marks.applied("s/0", (1, 0))
    in_the_way.rmdir()
    commit(tmp_path, 1, lanes={"s/0": (2, 0)})
    marks.refresh()
    assert marks.scanned == 1 and marks.applied("s/0", (2, 0))


def test_user_metadata_is_compact_json_naming_the_node_and_each_lanes_mark() -> None:
    # The format every node (and older releases) reads back from the log: keep it stable.
    text = LaneMarks.user_metadata("node-1", {"s/0": (3, 1), "s/5": (0, 0)})
    assert text == '{"deltaflow":{"node":"node-1","lanes":{"s/0":[3,1],"s/5":[0,0]}}}'


def test_highest_keeps_the_largest_mark_per_lane() -> None:
    marks = [("a", (1, 5)), ("b", (0, 0)), ("a", (2, 0)), ("a", (1, 9)), ("b", (0, 1))]
    assert LaneMarks.highest(marks) == {"a": (2, 0), "b": (0, 1)}
    assert LaneMarks.highest([]) == {}


def test_the_vector_of_each_live_file_is_tracked_through_adds_and_removes(tmp_path: Path) -> None:
    first, second = dv("AAAA", 1), dv("BBBB", 1)
    commit(tmp_path, 0, add("a.parquet"), add("b.parquet", first), add("c.parquet", dv("CCCC")))
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.vectors == {"b.parquet": first, "c.parquet": dv("CCCC")}
    # b's vector is replaced (merge-on-read); c's file is removed; a gets its first vector.
    commit(
        tmp_path,
        1,
        remove("b.parquet", first),
        add("b.parquet", second),
        remove("c.parquet", dv("CCCC")),
        add("a.parquet", dv("DDDD", None)),
    )
    marks.refresh()
    assert marks.vectors == {"b.parquet": second, "a.parquet": dv("DDDD", None)}


def test_a_remove_naming_an_older_vector_keeps_the_current_one(tmp_path: Path) -> None:
    current = dv("AAAA", 9)
    commit(tmp_path, 0, add("a.parquet", current), add("b.parquet", dv("BBBB", None)))
    # Another writer removed the file as it was before its current vector (same path and
    # storage, another offset; or no offset where the current one has one).
    commit(tmp_path, 1, remove("a.parquet", dv("AAAA", 1)), remove("b.parquet", dv("BBBB", 0)))
    commit(tmp_path, 2, remove("x.parquet", dv("XXXX")), remove("a.parquet"))
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.vectors == {"a.parquet": current, "b.parquet": dv("BBBB", None)}


def test_commit_vectors_lists_the_vectors_a_commit_names(tmp_path: Path) -> None:
    path = commit(
        tmp_path,
        0,
        remove("a.parquet", dv("AAAA")),
        add("a.parquet", dv("BBBB")),
        add("c.parquet"),
        remove("d.parquet", dv("DDDD")),
        {"add": {"path": "e.parquet", "deletionVector": None}},
        lanes={"s/0": (0, 0)},
    )
    assert commit_vectors(path) == [dv("AAAA"), dv("DDDD"), dv("BBBB")]


def _checkpoint(log: Path, version: int, rows: list[dict[str, Any]]) -> Path:
    vector = pa.struct(
        [
            ("storageType", pa.string()),
            ("pathOrInlineDv", pa.string()),
            ("offset", pa.int32()),
            ("sizeInBytes", pa.int32()),
            ("cardinality", pa.int64()),
        ]
    )
    action = pa.struct([("path", pa.string()), ("deletionVector", vector)])
    schema = pa.schema([("add", action), ("remove", action)])
    path = log / f"{version:020d}.checkpoint.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    (log / "_last_checkpoint").write_text(json.dumps({"version": version, "size": len(rows)}))
    return path


@pytest.mark.parametrize("first_kept", [1, 5])
def test_when_old_commits_are_gone_the_vectors_come_from_the_checkpoint(
    tmp_path: Path, first_kept: int
) -> None:
    log = tmp_path / "_delta_log"
    log.mkdir()
    # Commits before ``first_kept`` were cleaned up; the checkpoint at 5 lists the live files
    # (and the files removed, which are not live); commits from ``first_kept`` on are kept.
    _checkpoint(
        log,
        5,
        [
            {"add": {"path": "a.parquet", "deletionVector": dv("A5", None)}, "remove": None},
            {"add": {"path": "b.parquet", "deletionVector": dv("B0", None)}, "remove": None},
            {"add": {"path": "n.parquet", "deletionVector": None}, "remove": None},
            {"add": None, "remove": {"path": "x.parquet", "deletionVector": dv("XXXX")}},
        ],
    )
    for version in range(first_kept, 5):
        commit(tmp_path, version)
    commit(tmp_path, 5, remove("a.parquet", dv("A4", None)), add("a.parquet", dv("A5", None)))
    commit(tmp_path, 6, add("c.parquet", dv("CCCC")), lanes={"s/0": (6, 0)})
    marks = LaneMarks(tmp_path)
    marks.refresh()
    expected = {"a.parquet": dv("A5", None), "b.parquet": dv("B0", None), "c.parquet": dv("CCCC")}
    assert marks.vectors == expected
    assert marks.applied("s/0", (6, 0)) and marks.scanned == 6
    # Later refreshes read new commits only: the checkpoint is older than what they know.
    commit(tmp_path, 7, remove("b.parquet", dv("B0", None)), add("b.parquet", dv("B7", None)))
    marks.refresh()
    commit(tmp_path, 8, add("d.parquet"))
    marks.refresh()
    assert marks.vectors == {**expected, "b.parquet": dv("B7", None)}


def test_without_a_readable_checkpoint_only_the_kept_commits_count(tmp_path: Path) -> None:
    log = tmp_path / "_delta_log"
    commit(tmp_path, 1, add("a.parquet", dv("AAAA")))
    commit(tmp_path, 2, add("b.parquet", dv("BBBB")))
    for broken in ("not json", '{"size": 3}', '{"version": "x"}'):
        (log / "_last_checkpoint").write_text(broken)
        marks = LaneMarks(tmp_path)
        marks.refresh()
        assert marks.vectors == {"a.parquet": dv("AAAA"), "b.parquet": dv("BBBB")}, broken


def test_checkpoint_vectors_reads_the_asked_kinds_without_empty_fields(tmp_path: Path) -> None:
    path = _checkpoint(
        tmp_path,
        1,
        [
            {"add": {"path": "a.parquet", "deletionVector": dv("AAAA", None)}, "remove": None},
            {"add": {"path": "b.parquet", "deletionVector": None}, "remove": None},
            {"add": None, "remove": {"path": "x.parquet", "deletionVector": dv("XXXX", 4)}},
        ],
    )
    assert checkpoint_vectors(path, ("add",)) == [("a.parquet", dv("AAAA", None))]
    assert checkpoint_vectors(path, ("add", "remove")) == [
        ("a.parquet", dv("AAAA", None)),
        ("x.parquet", dv("XXXX", 4)),
    ]


def test_a_value_holding_a_unicode_line_separator_does_not_hide_a_commits_marks(
    tmp_path: Path,
) -> None:
    # A writer leaves U+2028 raw in a file's statistics (a row's min/max value); only "\n"
    # ends a line of the log. Read as ending there, the commit would lose its vectors and,
    # with its commitInfo after the add, its marks: a retried batch would be applied again.
    stats = json.dumps({"minValues": {"s": "a\u2028b\u0085c"}}, ensure_ascii=False)
    action = {"add": {**add("f.parquet", dv("v"))["add"], "stats": stats}}
    info = {"commitInfo": {"userMetadata": LaneMarks.user_metadata("n1", {"s/0": (7, 0)})}}
    log = tmp_path / "_delta_log"
    log.mkdir()
    lines = [json.dumps(action, ensure_ascii=False), json.dumps(info)]
    path = log / f"{0:020d}.json"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    marks = LaneMarks(tmp_path)
    marks.refresh()
    assert marks.applied("s/0", (7, 0)), "the commit's lane mark was not read"
    assert commit_vectors(path) == [dv("v")]
