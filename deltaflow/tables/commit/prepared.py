"""A group made ready for a table's committer: the files a writer wrote and the actions that
add them, pinned to the table version it read, and what the committer answers.

A writer (the owner of some partitions) applies a group in two halves. It prepares it alone:
drops the writes the table holds, writes the data files (and deletion vectors) that apply the
rest, and describes them as Delta ``add``/``remove`` actions checked against version
``read_version``. The table's committer (:mod:`.committer`) then commits the prepared groups
of many writers as one version. Nothing in a :class:`PreparedCommit` is rows: only actions,
lane marks and counts, a few hundred bytes per file.

Prepared commits travel between nodes (``POST /v1/peer/commit``), so :meth:`PreparedCommit.
from_wire` reads one as hostile input: every field typed and bounded, every file path one the
writers of a deltaflow table produce (a bucket directory and a parquet file, nothing encoded).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from ...protocol import RANDOM_LANE_PREFIX
from ..deletion_vectors import z85decode
from ..marks import Mark

__all__ = [
    "MAX_ACTIONS",
    "CommitSink",
    "Outcome",
    "OutcomeKind",
    "PreparedCommit",
    "WireError",
]

#: The most actions one prepared group may carry (a group touches at most a few files per
#: bucket; this bounds what a peer can make a committer hold).
MAX_ACTIONS: Final = 20_000
#: The most lanes one prepared group may carry.
MAX_LANES: Final = 20_000
#: The most deleted keys one prepared group may record (a group is bounded by rows anyway).
MAX_DELETED: Final = 1_000_000
_LANE: Final = re.compile(r"[\x21-\x7e]{1,300}")
_TABLE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,254}")
_NODE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: A data file's path in the log, as deltaflow's, delta-rs's and Spark's writers name them in a
#: deltaflow table: an optional bucket directory, then a parquet file name. No ``%`` (readers
#: URL-decode paths: ``%2E%2E/`` climbs out), no ``..``, no other directory, no scheme.
_FILE: Final = re.compile(
    r"(?:_deltaflow_bucket=(?:0|[1-9][0-9]{0,5})/)?(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9_.-]{0,250}\.parquet"
)
_ACTION_KINDS: Final = frozenset({"add", "remove"})
_DV_PREFIX: Final = re.compile(r"[A-Za-z0-9]{0,64}")
#: A ``u`` vector's file is named by the UUID its last characters encode (Z85), never by them.
_DV_ID_CHARS: Final = 20
_MAX_STRING: Final = 1 << 20  # a file's statistics (JSON) may be long with many columns


class WireError(ValueError):
    """A prepared commit (or an outcome) from a peer is malformed; the message says which
    field."""


@dataclass(frozen=True, slots=True)
class PreparedCommit:
    """One writer's group, ready for the table's committer.

    Attributes:
        table: the table's name.
        writer: the node that prepared it.
        read_version: the table version the actions were checked against: the files they
            remove were live there, and the lanes not applied.
        actions: Delta ``add``/``remove`` actions (as the log holds them, one key each).
        lanes: the highest mark of each lane the group applies (``LaneMarks.highest``).
        starts: the lowest mark of each of those lanes (``LaneMarks.lowest``): a lane's writes
            in a group are a run of its marks, applied in order, so the table holding the
            lowest means it holds some of them, and holding the highest, all.
        rows: rows the group applies (for statistics).
        batches: batches the group holds.
        deleted: the keys the group deletes from a ``sequence_by`` table, with their
            sequences (:func:`.sequence.recorded`): the commit records them.
        forgotten: lanes of closed random-id streams the writer forgot, for the commit to
            forget in the log too (:meth:`.LaneMarks.carrying`; only random lanes of the
            writer's own partitions are taken).
    """

    table: str
    writer: str
    read_version: int
    actions: list[dict[str, Any]]
    lanes: dict[str, Mark]
    starts: dict[str, Mark]
    rows: int = 0
    batches: int = 0
    deleted: dict[str, list[Any]] | None = None
    forgotten: tuple[str, ...] = ()
    removes: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.starts.keys() != self.lanes.keys() or any(
            self.starts[lane] > mark for lane, mark in self.lanes.items()
        ):
            raise WireError("starts: the lowest mark of each lane, at most its highest")
        removed = frozenset(
            a["remove"]["path"] for a in self.actions if "remove" in a and "path" in a["remove"]
        )
        object.__setattr__(self, "removes", removed)

    def to_wire(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "writer": self.writer,
            "read_version": self.read_version,
            "actions": self.actions,
            "lanes": {lane: list(mark) for lane, mark in self.lanes.items()},
            "starts": {lane: list(mark) for lane, mark in self.starts.items()},
            "rows": self.rows,
            "batches": self.batches,
            "deleted": self.deleted,
            "forgotten": list(self.forgotten),
        }

    @classmethod
    def from_wire(cls, data: Any) -> PreparedCommit:
        """Read a prepared commit a peer sent.

        Raises:
            WireError: a field is missing, mistyped, out of bounds, or names a file outside
                the table.
        """
        if not isinstance(data, Mapping):
            raise WireError("a prepared commit is a JSON object")
        table = _text(data, "table", _TABLE)
        writer = _text(data, "writer", _NODE)
        read_version = _count(data, "read_version")
        rows, batches = _count(data, "rows"), _count(data, "batches")
        actions = data.get("actions")
        if not isinstance(actions, list) or len(actions) > MAX_ACTIONS:
            raise WireError(f"actions: a list of at most {MAX_ACTIONS}")
        lanes, starts = _marks(data, "lanes"), _marks(data, "starts")
        actions = [_action(a) for a in actions]
        deleted = _deleted(data.get("deleted"))
        forgotten = _forgotten(data.get("forgotten", []))
        return cls(
            table, writer, read_version, actions, lanes, starts, rows, batches, deleted, forgotten
        )


def _forgotten(value: Any) -> tuple[str, ...]:
    """Lanes of random-id streams: a list of at most :data:`MAX_LANES` names."""
    if not isinstance(value, list) or len(value) > MAX_LANES:
        raise WireError(f"forgotten: a list of at most {MAX_LANES} lanes")
    for lane in value:
        if not (isinstance(lane, str) and _LANE.fullmatch(lane)):
            raise WireError(f"forgotten: a bad lane name {str(lane)[:40]!r}")
        if not lane.startswith(RANDOM_LANE_PREFIX):
            raise WireError(f"forgotten: {lane[:40]!r} is not a random id's lane")
    return tuple(value)


def _deleted(value: Any) -> dict[str, list[Any]] | None:
    """The deletes a group records: ``{"keys": [...], "seqs": [...]}`` of equal length, at
    most :data:`MAX_DELETED`, each a JSON scalar or a short list of them."""
    if value is None:
        return None
    if not (isinstance(value, Mapping) and set(value) == {"keys", "seqs"}):
        raise WireError("deleted: an object of keys and seqs")
    keys, seqs = value["keys"], value["seqs"]
    if not (isinstance(keys, list) and isinstance(seqs, list) and len(keys) == len(seqs)):
        raise WireError("deleted: keys and seqs, two lists of one length")
    if len(keys) > MAX_DELETED:
        raise WireError(f"deleted: at most {MAX_DELETED} keys")
    for entry in (*keys, *seqs):
        values = entry if isinstance(entry, list) else [entry]
        if len(values) > 32 or not all(_scalar(v) for v in values):
            raise WireError("deleted: each key and sequence a value or a list of values")
    return {"keys": keys, "seqs": seqs}


def _scalar(value: Any) -> bool:
    if isinstance(value, str):
        return len(value) <= 4096
    return value is None or isinstance(value, (bool, int, float))


def _marks(data: Mapping[str, Any], name: str) -> dict[str, Mark]:
    """A lane -> ``[seq, k]`` object of at most :data:`MAX_LANES` lanes."""
    lanes = data.get(name)
    if not isinstance(lanes, Mapping) or len(lanes) > MAX_LANES:
        raise WireError(f"{name}: an object of at most {MAX_LANES} lanes")
    marks: dict[str, Mark] = {}
    for lane, mark in lanes.items():
        if not (isinstance(lane, str) and _LANE.fullmatch(lane)):
            raise WireError(f"{name}: a bad lane name {str(lane)[:40]!r}")
        if not (
            isinstance(mark, list)
            and len(mark) == 2
            and all(type(x) is int and 0 <= x < 1 << 63 for x in mark)
        ):
            raise WireError(f"{name}[{lane!r}]: a mark is [seq, k], two counts")
        marks[lane] = (mark[0], mark[1])
    return marks


def _text(data: Mapping[str, Any], name: str, pattern: re.Pattern[str]) -> str:
    value = data.get(name)
    if not (isinstance(value, str) and pattern.fullmatch(value)):
        raise WireError(f"{name}: missing or malformed")
    return value


def _count(data: Mapping[str, Any], name: str) -> int:
    value = data.get(name)
    if type(value) is not int or not 0 <= value < 1 << 63:
        raise WireError(f"{name}: a count")
    return value


def _action(action: Any) -> dict[str, Any]:
    """One ``add`` or ``remove`` action, checked: the fields a data-file action has, of their
    types, its path inside the table."""
    if not (isinstance(action, Mapping) and len(action) == 1):
        raise WireError("an action is an object with one key")
    [(kind, body)] = action.items()
    if kind not in _ACTION_KINDS or not isinstance(body, Mapping):
        raise WireError(f"an action is add or remove, not {str(kind)[:20]!r}")
    path = body.get("path")
    if not (isinstance(path, str) and _FILE.fullmatch(path)):
        raise WireError(
            f"{kind}: a data file inside the table's own layout "
            "([_deltaflow_bucket=N/]NAME.parquet, without '%' or '..')"
        )
    checked: dict[str, Any] = {}
    for name, value in body.items():
        if name in ("path",):
            checked[name] = value
        elif name in ("size", "modificationTime", "deletionTimestamp"):
            if type(value) is not int or value < 0:
                raise WireError(f"{kind}.{name}: a count")
            checked[name] = value
        elif name in ("dataChange", "extendedFileMetadata"):
            if not isinstance(value, bool):
                raise WireError(f"{kind}.{name}: a boolean")
            checked[name] = value
        elif name == "stats":
            if not (isinstance(value, str) and len(value) <= _MAX_STRING):
                raise WireError(f"{kind}.stats: a string")
            checked[name] = value
        elif name == "partitionValues":
            checked[name] = _partition_values(kind, value)
        elif name == "deletionVector":
            checked[name] = _deletion_vector(kind, value)
        else:
            raise WireError(f"{kind}: unexpected field {str(name)[:40]!r}")
    return {kind: checked}


def _partition_values(kind: str, value: Any) -> dict[str, str | None]:
    if not (isinstance(value, Mapping) and len(value) <= 8):
        raise WireError(f"{kind}.partitionValues: an object")
    for k, v in value.items():
        if not (isinstance(k, str) and len(k) <= 255 and (v is None or isinstance(v, str))):
            raise WireError(f"{kind}.partitionValues: names to strings or null")
        if v is not None and len(v) > 1000:
            raise WireError(f"{kind}.partitionValues: a value too long")
    return dict(value)


def _deletion_vector(kind: str, value: Any) -> dict[str, Any]:
    """A deletion vector descriptor: stored in a file beside the table (``u``) or inline
    (``i``), by the fields of the Delta protocol."""
    if not (isinstance(value, Mapping) and value.get("storageType") in ("u", "i")):
        raise WireError(f"{kind}.deletionVector: a descriptor stored beside the table or inline")
    allowed = {"storageType": str, "pathOrInlineDv": str, "offset": int, "sizeInBytes": int}
    allowed["cardinality"] = int
    out: dict[str, Any] = {}
    for name, v in value.items():
        kind_of = allowed.get(name)
        if kind_of is None or type(v) is not kind_of:
            raise WireError(f"{kind}.deletionVector.{str(name)[:40]}: not a descriptor field")
        if isinstance(v, str) and len(v) > 4096:
            raise WireError(f"{kind}.deletionVector.{name}: too long")
        out[name] = v
    where = out.get("pathOrInlineDv", "")
    # Stored beside the table: a 20-character encoded id after an optional prefix of letters
    # and digits (the prefix is a directory: nothing in it may climb out of the table).
    if out["storageType"] == "u" and not (
        len(where) >= _DV_ID_CHARS
        and _DV_PREFIX.fullmatch(where[:-_DV_ID_CHARS])
        and _is_z85(where[-_DV_ID_CHARS:])
    ):
        raise WireError(
            f"{kind}.deletionVector.pathOrInlineDv: a prefix of letters and digits, then a "
            "vector id in Z85"
        )
    return out


def _is_z85(text: str) -> bool:
    try:
        z85decode(text)
    except ValueError:
        return False
    return True


class OutcomeKind(enum.StrEnum):
    COMMITTED = "committed"  # in the version named
    APPLIED = "applied"  # the table held every lane already: nothing committed for it
    RETRY = "retry"  # prepare it again (the table changed under it, or a lane moved)
    FAILED = "failed"  # the commit failed (the reason says why); the writer fails the group


@dataclass(frozen=True, slots=True)
class Outcome:
    """The committer's answer to one prepared commit."""

    kind: OutcomeKind
    version: int | None = None
    reason: str = ""
    committer: str = ""

    def to_wire(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "version": self.version,
            "reason": self.reason,
            "committer": self.committer,
        }

    @classmethod
    def from_wire(cls, data: Any) -> Outcome:
        if not isinstance(data, Mapping):
            raise WireError("an outcome is a JSON object")
        try:
            kind = OutcomeKind(str(data.get("kind")))
        except ValueError:
            raise WireError("outcome.kind: unknown") from None
        version = data.get("version")
        if version is not None and (type(version) is not int or version < 0):
            raise WireError("outcome.version: a count or null")
        reason, committer = data.get("reason", ""), data.get("committer", "")
        if not (isinstance(reason, str) and isinstance(committer, str)):
            raise WireError("outcome.reason and committer: strings")
        return cls(kind, version, reason[:2000], committer[:64])


class CommitSink(Protocol):
    """Where a writer sends its prepared groups: the table's committer, here or on a peer."""

    async def submit(self, prepared: PreparedCommit) -> Outcome:
        """The committer's outcome for ``prepared``."""
        ...
