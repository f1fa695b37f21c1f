"""Cluster identity: what nodes compare before they share partitions.

The warehouse holds ``.deltaflow/cluster.json``, written once by the first node that starts on
it and read by every other. A node's :class:`NodeIdentity` is that record plus the node's
warehouse location and partition count; two nodes share partitions only if their identities
are equal. (Engines may differ: every engine writes the same tables the same way, and a
table's committer commits what either prepared.) When nodes that see each other disagree,
:func:`decide` picks the identity that goes on serving, the same way on every node, and the
others are refused.

The record is behind :class:`IdentityStore` so that a warehouse on an object store can keep it
with a conditional PUT instead of a hard link.

Beside it, every node publishes the public half of a signing key it makes at start
(``.deltaflow/nodes/<node id>.json``, :class:`NodeKey`): its calls to peers are signed, and a
called node checks the signature with the key the warehouse holds for the id the caller
claims (:class:`PeerKeys`). Whoever may write the warehouse may name a node's key; whoever
holds only the peer token may not speak as a node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol
from urllib.parse import urlparse
from urllib.request import url2pathname

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from tenacity import Retrying, retry_if_exception_type, stop_after_delay, wait_fixed

from ..errors import UsageError
from ..security import NODE_ID
from ..storage.paths import Location, StorePath, location

__all__ = [
    "CLUSTER_FILE",
    "NODE_KEYS_DIR",
    "Candidate",
    "ClusterRecord",
    "FileIdentityStore",
    "IdentityStore",
    "NodeIdentity",
    "NodeKey",
    "PeerKeys",
    "Verdict",
    "decide",
    "identity_store",
    "load_identity",
    "refusal_message",
    "winning_identity",
]

log = logging.getLogger(__name__)

#: Where the cluster record lives, relative to the warehouse.
CLUSTER_FILE: Final = ".deltaflow/cluster.json"
#: Where each node's public signing key lives, relative to the warehouse (``<node id>.json``).
NODE_KEYS_DIR: Final = ".deltaflow/nodes"
#: Seconds before a node id whose signature failed (or that has no key) is read again: a
#: restarted node published a new key, but a caller cannot make the warehouse read at will.
KEY_REREAD_SECONDS: Final = 1.0
#: Node keys a node keeps (a peer-token holder may claim many ids; each costs one entry).
MAX_KEYS: Final = 1024


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterRecord:
    """The content of ``cluster.json``: created once per warehouse, never changed."""

    cluster_id: str
    created_at_ms: int
    created_by: str


class IdentityStore(Protocol):
    """Keeps a warehouse's :class:`ClusterRecord`. Blocking: call it from a worker thread."""

    @property
    def location(self) -> str:
        """The warehouse as one normalised string (a URI), equal on nodes that share it."""
        ...

    def load_or_create(self, node_id: str) -> ClusterRecord:
        """The record; if there is none, create it (only one creator wins a race).

        Raises:
            UsageError: the record exists but is malformed, or cannot be created.
        """
        ...


class FileIdentityStore:
    """The record as a file in a local or mounted warehouse directory."""

    def __init__(self, warehouse: Location | str) -> None:
        self.root = location(warehouse).expanduser().resolve()
        self.path = self.root / CLUSTER_FILE

    @property
    def location(self) -> str:
        return self.root.as_uri()

    def load_or_create(self, node_id: str) -> ClusterRecord:
        if not self.path.exists():
            self._create(node_id)
            # On an object store a racing creator's PUT can be refused ("exists", or a
            # conflicting conditional write) before the winner's object is readable.
            with contextlib.suppress(FileNotFoundError):  # then _read says what is wrong
                self._await_record()
        return self._read()

    def _await_record(self) -> None:
        for attempt in Retrying(
            retry=retry_if_exception_type(FileNotFoundError),
            stop=stop_after_delay(10),
            wait=wait_fixed(0.1),
            reraise=True,
        ):
            with attempt:
                self.path.read_bytes()

    def _create(self, node_id: str) -> None:
        record = ClusterRecord(
            cluster_id=uuid.uuid4().hex,
            created_at_ms=time.time_ns() // 1_000_000,
            created_by=node_id,
        )
        if isinstance(self.path, StorePath):
            try:  # a create-if-absent put: exactly one node of a race creates it
                self.path.create(json.dumps(dataclasses.asdict(record)).encode())
            except FileExistsError:
                pass  # another node was first; its record is the cluster's
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f"{self.path.name}.{uuid.uuid4().hex}.tmp")
        try:
            with tmp.open("x") as out:
                json.dump(dataclasses.asdict(record), out)
                out.flush()
                os.fsync(out.fileno())
            # A hard link never replaces a file: of several nodes racing, exactly one creates it,
            # and readers never see it half written.
            os.link(tmp, self.path)
        except FileExistsError:
            pass  # another node was first; its record is the cluster's
        except OSError as exc:
            raise UsageError(
                f"cannot create the cluster identity file {self.path}: {exc} (the warehouse "
                "must be writable, on a filesystem with hard links)"
            ) from exc
        finally:
            tmp.unlink(missing_ok=True)

    def _read(self) -> ClusterRecord:
        try:
            text = self.path.read_text()
        except OSError as exc:
            raise UsageError(f"cannot read the cluster identity file {self.path}: {exc}") from exc
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise _malformed(self.path, f"not JSON: {exc}") from exc
        fields = ("cluster_id", "created_at_ms", "created_by")
        if not isinstance(data, dict) or any(f not in data for f in fields):
            raise _malformed(self.path, f"it does not hold all of {', '.join(fields)}")
        record = ClusterRecord(**{f: data[f] for f in fields})
        if not (
            isinstance(record.cluster_id, str)
            and record.cluster_id
            and _is_int(record.created_at_ms)
            and isinstance(record.created_by, str)
        ):
            raise _malformed(self.path, "a field has the wrong type")
        return record


class NodeKey:
    """This node's signing key (Ed25519), made at start and never stored: a restart makes a
    new one and publishes it (:meth:`publish`), so there is no private key file to guard."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._private = Ed25519PrivateKey.generate()
        self.public = self._private.public_key().public_bytes_raw()

    def sign(self, message: bytes) -> str:
        """The signature of ``message``, hex."""
        return self._private.sign(message).hex()

    def publish(self, warehouse: Location | str) -> None:
        """Write the public key to ``.deltaflow/nodes/<node id>.json`` in ``warehouse``,
        replacing the one an earlier run of this node wrote. Blocking.

        Raises:
            UsageError: the warehouse cannot be written.
        """
        target = _key_path(warehouse, self.node_id)
        record = {
            "node": self.node_id,
            "public_key": self.public.hex(),
            "published_at_ms": time.time_ns() // 1_000_000,
        }
        data = json.dumps(record).encode()
        try:
            if isinstance(target, StorePath):
                target.write_bytes(data)  # a PUT replaces the object whole
                return
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f"{target.name}.{uuid.uuid4().hex}.tmp")
            try:
                with tmp.open("xb") as out:
                    out.write(data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, target)  # readers see the old key or the new, never half
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as exc:
            raise UsageError(
                f"cannot publish node {self.node_id}'s signing key at {target}: {exc} (the "
                "warehouse must be writable)"
            ) from exc


def _key_path(warehouse: Location | str, node_id: str) -> Location:
    if not NODE_ID.fullmatch(node_id):
        raise ValueError(f"not a node id: {node_id[:80]!r}")
    return location(warehouse).expanduser().resolve() / NODE_KEYS_DIR / f"{node_id}.json"


def read_node_key(warehouse: Location | str, node_id: str) -> bytes | None:
    """The public key the warehouse holds for ``node_id`` (None: none, or unreadable).
    Blocking."""
    path = _key_path(warehouse, node_id)
    try:
        record = json.loads(path.read_bytes())
        key = bytes.fromhex(record["public_key"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        log.warning("cannot read node %s's signing key at %s: %s", node_id, path, exc)
        return None
    if record.get("node") != node_id or len(key) != 32:
        log.warning("the signing key at %s is not node %s's", path, node_id)
        return None
    return key


@dataclass(slots=True)
class _Known:
    key: Ed25519PublicKey | None
    read_at: float


class PeerKeys:
    """The public keys of a warehouse's nodes, read when first needed and again, at most once
    per :data:`KEY_REREAD_SECONDS` per node, when a signature does not match (the node
    restarted with a new key)."""

    def __init__(self, warehouse: Location | str) -> None:
        self._warehouse = warehouse
        self._known: dict[str, _Known] = {}
        self._reading: dict[str, asyncio.Task[_Known]] = {}

    async def verify(self, node_id: str, message: bytes, signature: str) -> bool:
        """Whether ``signature`` (hex) is ``node_id``'s over ``message``."""
        try:
            raw = bytes.fromhex(signature)
        except ValueError:
            return False
        known = self._known.get(node_id)
        if known is not None and _valid(known.key, raw, message):
            return True
        if known is not None and time.monotonic() - known.read_at < KEY_REREAD_SECONDS:
            return False
        reading = self._reading.get(node_id)
        if reading is None:
            reading = asyncio.ensure_future(self._read(node_id))
            self._reading[node_id] = reading
            reading.add_done_callback(lambda _: self._reading.pop(node_id, None))
        known = await asyncio.shield(reading)
        return _valid(known.key, raw, message)

    async def _read(self, node_id: str) -> _Known:
        raw = await asyncio.to_thread(read_node_key, self._warehouse, node_id)
        known = _Known(Ed25519PublicKey.from_public_bytes(raw) if raw else None, time.monotonic())
        self._known.pop(node_id, None)
        while len(self._known) >= MAX_KEYS:  # the longest unread goes first
            del self._known[next(iter(self._known))]
        self._known[node_id] = known
        return known


def _valid(key: Ed25519PublicKey | None, signature: bytes, message: bytes) -> bool:
    if key is None:
        return False
    try:
        key.verify(signature, message)
    except InvalidSignature:
        return False
    return True


def _malformed(path: Location, why: object) -> UsageError:
    return UsageError(
        f"the cluster identity file {path} is malformed ({why}); write it again from the "
        "'identity' in a running node's /v1/cluster answer, or delete it and restart every node "
        "of this warehouse (they then form a new cluster)"
    )


def identity_store(warehouse: Location | str) -> IdentityStore:
    """The store for a warehouse location (a directory, or a prefix on an object store)."""
    return FileIdentityStore(warehouse)


@dataclass(frozen=True, slots=True, kw_only=True)
class NodeIdentity:
    """What must be equal on two nodes for them to share partitions.

    Attributes:
        cluster_id: the warehouse's cluster record id (uuid4 hex).
        created_at_ms: when that record was created (wall clock, ms).
        warehouse: the warehouse location, normalised (``file:///...`` for a directory).
        partitions: the partition count.
    """

    cluster_id: str
    created_at_ms: int
    warehouse: str
    partitions: int

    def to_wire(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_wire(cls, data: Any) -> NodeIdentity:
        """Raises ValueError unless ``data`` is a well-formed identity object."""
        if not isinstance(data, dict):
            raise ValueError("no cluster identity")  # noqa: TRY004  (a wire value, not an argument)
        try:
            identity = cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})
        except KeyError as exc:
            raise ValueError(f"cluster identity without {exc}") from exc
        texts = (identity.cluster_id, identity.warehouse)
        if not all(isinstance(t, str) for t in texts):
            raise ValueError("cluster identity with a non-string field")
        if not (_is_int(identity.created_at_ms) and _is_int(identity.partitions)):
            raise ValueError("cluster identity with a non-integer field")
        return identity

    def sort_key(self) -> tuple[str, int, str, int]:
        return (self.cluster_id, self.created_at_ms, self.warehouse, self.partitions)

    def describe(self) -> str:
        return (
            f"cluster {self.cluster_id}, warehouse {self.warehouse}, {self.partitions} partitions"
        )


def load_identity(
    warehouse: Location | str,
    *,
    node_id: str,
    partitions: int,
    store: IdentityStore | None = None,
) -> NodeIdentity:
    """Read (or create) the warehouse's cluster record and return this node's identity.

    Blocking: call it from a worker thread.

    Raises:
        UsageError: the record is malformed or cannot be created.
    """
    store = store or identity_store(warehouse)
    record = store.load_or_create(node_id)
    return NodeIdentity(
        cluster_id=record.cluster_id,
        created_at_ms=record.created_at_ms,
        warehouse=store.location,
        partitions=partitions,
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- Deciding between identities ----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """One node as a decision sees it: itself, or a peer that answered in time."""

    node_id: str
    identity: NodeIdentity
    serving: bool


@dataclass(frozen=True, slots=True)
class Verdict:
    admitted: bool
    winner: NodeIdentity


def winning_identity(candidates: Iterable[Candidate]) -> NodeIdentity:
    """The identity with the most serving nodes, then the most nodes, then the oldest cluster
    record, then the smallest :meth:`NodeIdentity.sort_key`: every node that sees the same
    candidates picks the same one, and a running cluster outranks nodes that are joining it.
    """
    groups: dict[NodeIdentity, list[Candidate]] = {}
    for candidate in candidates:
        groups.setdefault(candidate.identity, []).append(candidate)
    if not groups:
        raise ValueError("no candidates")

    def rank(identity: NodeIdentity) -> tuple[int, int, int, tuple[str, int, str, int]]:
        nodes = groups[identity]
        serving = sum(1 for c in nodes if c.serving)
        return (-serving, -len(nodes), identity.created_at_ms, identity.sort_key())

    return min(groups, key=rank)


def decide(own: Candidate, peers: Sequence[Candidate], *, refused: bool = False) -> Verdict:
    """Whether this node may own partitions, given what it sees.

    A node is admitted when its identity wins. One that was refused before is admitted again
    only beside a serving peer of its own identity: it never serves on its own authority, so a
    misconfigured node that outlives the cluster that refused it does not take over.
    """
    winner = winning_identity([own, *peers])
    admitted = winner == own.identity and (
        not refused or any(p.serving and p.identity == own.identity for p in peers)
    )
    return Verdict(admitted=admitted, winner=winner)


def refusal_message(
    loser_id: str, loser: NodeIdentity, winner_id: str, winner: NodeIdentity
) -> str:
    """Why ``loser_id`` is refused, naming both sides and what to change, one clause per field
    that differs (the same text on both nodes)."""
    differences: list[str] = []
    flags: list[str] = []
    other_storage = False
    if loser.warehouse != winner.warehouse:
        differences.append(
            f"its warehouse {loser.warehouse} (cluster {_short(loser)}) differs from node "
            f"{winner_id}'s {winner.warehouse} (cluster {_short(winner)})"
        )
        flags.append(f"--warehouse {_location_arg(winner.warehouse)}")
    elif (loser.cluster_id, loser.created_at_ms) != (winner.cluster_id, winner.created_at_ms):
        other_storage = True
        differences.append(
            f"its warehouse {loser.warehouse} holds cluster {_short(loser)} and node "
            f"{winner_id}'s holds cluster {_short(winner)} (different storage at one path, or "
            f"a replaced {CLUSTER_FILE})"
        )
    if loser.partitions != winner.partitions:
        differences.append(
            f"its partition count {loser.partitions} differs from node {winner_id}'s "
            f"{winner.partitions}"
        )
        flags.append(f"--partitions {winner.partitions}")
    fixes = [f"start {loser_id} with {' '.join(flags)}"] if flags else []
    if other_storage:
        fixes.append(
            f"mount the warehouse of node {winner_id} at {_location_arg(winner.warehouse)} on "
            f"{loser_id}'s machine and restart {loser_id}"
        )
    return f"node {loser_id} refused by the cluster: {' and '.join(differences)}; " + "; ".join(
        fixes
    )


def _short(identity: NodeIdentity) -> str:
    return identity.cluster_id[:8]


def _location_arg(location: str) -> str:
    """A location as ``--warehouse`` takes it: a path for ``file:`` URIs."""
    parsed = urlparse(location)
    return url2pathname(parsed.path) if parsed.scheme == "file" else location
