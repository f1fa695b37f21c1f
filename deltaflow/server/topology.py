"""Cluster membership and the partition map, seen from one node.

Each node polls its peers' ``/v1/cluster`` endpoint every ``heartbeat_interval`` seconds, and at
once when a peer it does not count as live contacts it. A peer is live when it answered within
``failure_timeout`` seconds with the cluster identity that wins (see :mod:`.identity`); one
whose identity loses is refused. The partition map is computed from the live set (self
included) by rendezvous hashing, so every node with the same view computes the same map; its
version is the time (ms) the view last changed, so a newer view wins. A node whose own identity
loses owns no partition and hands out the winners' map instead.

A peer whose poll fails is suspected and polled faster; two refused connections confirm it
down before ``failure_timeout``; a failed call to it brings the polls forward (``hint``). A
peer that drains (:meth:`Membership.leave`) is taken out at once, once a poll of its own
confirms it. A node learns of peers beyond ``peers`` only from
their proven polls, and of at most ``MAX_LEARNED_PEERS``; every such change is logged at
WARNING with the node that asked. A peer counts as a member only if its answer is signed with
the key the warehouse holds for the node id it names: the peer secret alone cannot answer as a
node. The HTTP calls themselves are :mod:`.peers`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any, Final

from ..logs import event
from ..partitioning import PartitionMap
from .identity import (
    NODE_KEYS_DIR,
    Candidate,
    NodeIdentity,
    NodeKey,
    PeerKeys,
    decide,
    refusal_message,
)
from .members import DOWN_BECAUSE, Member, PeerState, record
from .peers import Answer, PeerClient, Silence

__all__ = ["DEFAULT_PEER_EXPIRY", "MAX_LEARNED_PEERS", "Member", "Membership", "PeerState"]

log = logging.getLogger(__name__)

#: Seconds a peer may stay unanswered before it counts as having left the cluster.
DEFAULT_PEER_EXPIRY: Final = 60.0
#: Seconds between polls of a suspected peer (one whose last poll failed).
SUSPECT_POLL_INTERVAL: Final = 0.1
#: A suspected peer is down at once (without waiting for ``failure_timeout``) when connections
#: to it are refused twice this many seconds apart: nothing listens at its address any more.
#: A slow or paused process never refuses a connection (the kernel accepts it), so load alone
#: cannot make a peer look down this way.
REFUSALS_APART: Final = 0.1
#: Most peers a node learns of from their polls (beyond those it was given): a caller holding
#: the peer secret still cannot make it poll addresses without bound.
MAX_LEARNED_PEERS: Final = 32


class _Status(enum.Enum):
    JOINING = "joining"  # before the first round of polls
    ADMITTED = "admitted"
    REFUSED = "refused"


class Membership:
    """Tracks which peers are live, decides whether this node may serve, derives the map.

    Args:
        node_id: this node's id.
        address: this node's ``host:port`` as peers and clients reach it.
        peers: other nodes' ``host:port``.
        identity: this node's cluster identity (its partition count is the map's).
        heartbeat_interval: seconds between polls of each peer.
        failure_timeout: seconds without an answer after which a peer is considered dead.
        peer_expiry: seconds without an answer after which a peer has left; one that was not
            in ``peers`` is then no longer polled.
        secret: the peer secret each poll proves and each answer must prove (never sent).
        certificates: without a secret, peers prove themselves by a certificate with the
            peer role (mutual TLS).
        tls: the SSL context peers are polled over (``https``); None: plain ``http``.
        signer: this node's signing key: its polls and leaves are signed with it.
        keys: the warehouse's node keys: a peer whose answer is not signed with the key of
            the node id it names owns no partition, and (with a secret or certificates) has
            no say in which cluster identity wins; None: answers are not checked.
    """

    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        peers: Sequence[str],
        identity: NodeIdentity,
        heartbeat_interval: float = 0.5,
        failure_timeout: float = 3.0,
        peer_expiry: float = DEFAULT_PEER_EXPIRY,
        secret: str | None = None,
        certificates: bool = False,
        tls: ssl.SSLContext | None = None,
        receivers: Sequence[str] = (),
        signer: NodeKey | None = None,
        keys: PeerKeys | None = None,
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.receivers = tuple(receivers)  # this node's: shown with the members
        self.identity = identity
        self.partitions = identity.partitions
        self.heartbeat_interval = heartbeat_interval
        self.failure_timeout = failure_timeout
        self.peer_expiry = peer_expiry
        self._peer_client = PeerClient(
            node_id=node_id,
            address=address,
            secret=secret,
            certificates=certificates,
            tls=tls,
            timeout=max(heartbeat_interval * 2, 1.0),
            signer=signer,
            keys=keys,
        )
        self._keys_checked = keys is not None
        # With a peer credential, an unsigned answer cannot even refuse this node: an open
        # loopback cluster hears a node on another warehouse (whose key it cannot read) so.
        self._signed_only = keys is not None and (secret is not None or certificates)
        now = time.monotonic()
        self._peers = {a: Member(a, since=now) for a in peers if a != address}
        self._map = PartitionMap.build(_now_ms(), {node_id: address}, self.partitions)
        self._own_map = True  # False while the map is the winners' (this node refused)
        self._leaving = False  # draining: this node owns no partition any more
        self._status = _Status.JOINING
        self._refused_by: NodeIdentity | None = None
        self._refusal: str | None = None
        self._changed = asyncio.Event()
        #: Called with the new map on each change (a committer checks groups against it).
        self.map_listeners: list[Callable[[PartitionMap], None]] = []
        self._wake = asyncio.Event()
        self._hinted = 0.0  # when a hint last woke the polls
        self._task: asyncio.Task[None] | None = None

    @property
    def map(self) -> PartitionMap:
        return self._map

    @property
    def admitted(self) -> bool:
        return self._status is _Status.ADMITTED

    @property
    def refusal(self) -> str | None:
        """Why this node is refused (it then owns no partition), or None."""
        return self._refusal

    @property
    def serving(self) -> bool:
        """Admitted, and has heard from every configured peer (or given up on it): only then
        does this node outrank newcomers in a conflict (see :func:`.identity.decide`)."""
        now = time.monotonic()
        settled = all(
            m.last_seen or now - m.since > self.peer_expiry
            for m in self._peers.values()
            if m.configured
        )
        return self.admitted and settled

    def owns(self, partition: int) -> bool:
        return self.admitted and self._map.owners[partition] == self.node_id

    @property
    def leaving(self) -> bool:
        """This node is draining: it handed its partitions to its peers."""
        return self._leaving

    def members(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        me = PeerState.DRAINING if self._leaving else PeerState.LIVE
        me = PeerState.REFUSED if self._refusal else me
        rows: list[dict[str, Any]] = [
            {
                "node": self.node_id,
                "address": self.address,
                "live": me is PeerState.LIVE,
                "state": me.value,
                "self": True,
                "refused": self._refusal,
                "receivers": list(self.receivers),
            }
        ]
        for m in self._peers.values():
            state = self._state(m, now)
            why = (m.conflict or m.own_refusal) if state is PeerState.REFUSED else None
            rows.append(
                {
                    "node": m.node_id,
                    "address": m.address,
                    "live": state is PeerState.LIVE,
                    "state": state.value,
                    "self": False,
                    "last_seen_ago": round(now - m.last_seen, 3) if m.last_seen else None,
                    "refused": why,
                    "receivers": list(m.receivers) if m.receivers is not None else None,
                }
            )
        return rows

    async def wait_for_members(self, count: int) -> PartitionMap:
        """Wait until this node is admitted and its map holds at least ``count`` nodes (self
        included)."""
        while not (self.admitted and len(self._map.addresses) >= count):
            await self._changed.wait()
        return self._map

    async def start(self) -> None:
        """Poll peers once and decide (so a node starting beside live peers begins with the
        full map, and a refused one never owns a partition), then keep polling."""
        await self._peer_client.start()
        await self._poll_all()
        self._task = asyncio.create_task(self._loop(), name="deltaflow-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._peer_client.close()

    async def leave(self) -> list[str]:
        """Drain: tell every live peer this node is leaving (each drops it from its map at
        once), then own no partition and hand out a map naming the new owners; the ids of the
        peers that took the news (the others see it at their next poll). A node without live
        peers keeps its map: there is no one to hand the partitions to."""
        now = time.monotonic()
        live = [m for m in self._peers.values() if self._state(m, now) is PeerState.LIVE]
        told = await asyncio.gather(
            *(self._peer_client.tell_leaving(m.address, m.node_id) for m in live)
        )
        self._leaving = True
        self._decide(time.monotonic())
        return [str(m.node_id) for m, ok in zip(live, told, strict=True) if ok]

    async def departed(self, node_id: str, address: str) -> bool:
        """A peer says it drains: take it out of the map now if a poll of it confirms it.
        False if no peer of that id is at that address, or its own answer does not say it
        drains: a leave is taken only from the leaving node itself."""
        member = self._peers.get(address)
        if member is None or member.node_id != node_id:
            event(log, "refusal", f"refused a leave for {node_id} at {address}: no peer of "
                  "that name at that address", level=logging.WARNING, code="LEAVE_REFUSED",
                  peer=node_id, address=address)  # fmt: skip
            return False
        asked = time.monotonic()
        answer = await self._peer_client.poll(address)
        now = time.monotonic()
        # Confirmed by that node: an answer in its name without its key's signature is not it.
        if not (
            isinstance(answer, Answer)
            and answer.proven
            and answer.node_id == node_id
            and (answer.signed or not self._keys_checked)
        ):
            event(log, "refusal", f"refused a leave for {node_id} at {address}: its answer "
                  "did not confirm it", level=logging.WARNING, code="LEAVE_REFUSED",
                  peer=node_id, address=address)  # fmt: skip
            return False
        record(member, answer, asked, now)
        if not answer.draining:
            event(log, "refusal", f"refused a leave for {node_id} at {address}: its own "
                  "answer says it does not drain", level=logging.WARNING, code="LEAVE_REFUSED",
                  peer=node_id, address=address)  # fmt: skip
            self._decide(now)
            return False
        self._decide(now)
        event(log, "member.left", f"peer {node_id} at {address} left (it asked); its "
              "partitions move now", peer=node_id, address=address, asked_by=node_id)  # fmt: skip
        return True

    def observe(self, node_id: str, address: str) -> None:
        """A peer's proven poll reached us. Only a poll of it can make it live: an unknown,
        dead or renamed peer is polled at once; a live one with the same id counts as seen."""
        if not address or address == self.address:
            return
        now = time.monotonic()
        member = self._peers.get(address)
        if member is None:
            for gone in [
                a
                for a, m in self._peers.items()
                if not m.configured and self._state(m, now) is PeerState.LEFT
            ]:
                del self._peers[gone]
            learned = sum(1 for m in self._peers.values() if not m.configured)
            if learned >= MAX_LEARNED_PEERS:
                event(log, "member.ignored", f"ignored peer {node_id} at {address}: this node "
                      f"already learned of {learned} peers beyond its --peers; list the "
                      "cluster's nodes in --peers", level=logging.WARNING, peer=node_id,
                      address=address)  # fmt: skip
                return
            self._peers[address] = Member(address, configured=False, since=now)
            event(log, "member.learned", f"learned of peer {node_id} at {address} from its "
                  "poll; polling it", peer=node_id, address=address)  # fmt: skip
            self._wake.set()
            return
        state = self._state(member, now)
        if member.node_id == node_id and state is PeerState.LIVE:
            member.last_seen = now
        elif member.node_id != node_id or state in (PeerState.DEAD, PeerState.LEFT):
            if not member.configured:
                member.since = now  # polled again from now on, even if it had left
            self._wake.set()

    def hint(self, address: str) -> None:
        """A call to the live peer at ``address`` failed: poll now, not at the next heartbeat
        (at most once per ``SUSPECT_POLL_INTERVAL``; the answers decide)."""
        now, member = time.monotonic(), self._peers.get(address)
        live = member is not None and not member.suspected and self._answered(member, now)
        if live and now - self._hinted >= SUSPECT_POLL_INTERVAL:
            self._hinted = now
            self._wake.set()

    # -- polling ---------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            # Quick polls only while a suspicion can still be confirmed: a peer that is down,
            # or silent past failure_timeout, is back to the normal pace.
            now = time.monotonic()
            suspects = any(m.suspected and self._answered(m, now) for m in self._peers.values())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(
                    SUSPECT_POLL_INTERVAL if suspects else self.heartbeat_interval
                ):
                    await self._wake.wait()
            self._wake.clear()
            await self._poll_all()

    async def _poll_all(self) -> None:
        asked = now = time.monotonic()
        targets = [m for m in self._peers.values() if self._polled(m, now)]
        answers = await asyncio.gather(*(self._peer_client.poll(m.address) for m in targets))
        now = time.monotonic()
        for member, answer in zip(targets, answers, strict=True):
            if isinstance(answer, Answer):
                record(member, answer, asked, now)
            else:
                self._suspect(member, answer, now)
        self._decide(now)

    def _suspect(self, member: Member, silence: Silence, now: float) -> None:
        """A poll of ``member`` failed: suspect it (it is then polled every
        ``SUSPECT_POLL_INTERVAL``), and count it down once two connections to it, at least
        ``REFUSALS_APART`` seconds apart, were refused."""
        if not self._answered(member, now) or member.down:
            return  # not live: nothing to take away
        if not member.suspected:
            member.suspected = now
            event(log, "member.suspected", f"peer {member.node_id} at {member.address} "
                  f"suspected: {silence.value}", peer=member.node_id, address=member.address,
                  reason=silence.value)  # fmt: skip
        if silence not in (Silence.REFUSED, Silence.STARTING):
            return  # a starting process answers in place of the one that was there
        if not member.first_refusal:
            member.first_refusal = now
        elif now - member.first_refusal >= REFUSALS_APART:
            member.down = now
            event(log, "member.down", f"peer {member.node_id} at {member.address} is down: "
                  f"{DOWN_BECAUSE[silence]} for {now - member.first_refusal:.2f}s, "
                  f"{now - member.last_seen:.2f}s after its last answer", level=logging.WARNING,
                  peer=member.node_id, address=member.address,
                  silent_seconds=round(now - member.last_seen, 3))  # fmt: skip

    def _polled(self, member: Member, now: float) -> bool:
        return member.configured or self._state(member, now) is not PeerState.LEFT

    def _answered(self, member: Member, now: float) -> bool:
        return self._recent(member, now) and not member.down and not member.draining

    def _recent(self, member: Member, now: float) -> bool:
        return bool(member.last_seen) and now - member.last_seen <= self.failure_timeout

    def _state(self, member: Member, now: float) -> PeerState:
        if self._answered(member, now):
            refused = member.conflict or member.own_refusal
            return PeerState.REFUSED if refused else PeerState.LIVE
        if member.draining:  # it said it leaves: gone on purpose, not dead
            recent = self._recent(member, now) and not member.down
            return PeerState.DRAINING if recent else PeerState.LEFT
        silent_since = max(member.last_seen, member.since)
        return PeerState.LEFT if now - silent_since > self.peer_expiry else PeerState.DEAD

    # -- deciding (synchronous: one step on the event loop) ------------------------------------

    def _decide(self, now: float) -> None:
        before = (self._status, self._map)
        answered = [m for m in self._peers.values() if self._answered(m, now)]
        comparable = [
            m
            for m in answered
            if m.identity is not None
            and m.node_id not in (None, self.node_id)
            # Another identity's keys are in its own warehouse, out of reach: its proven
            # answer may refuse this node (as a drain could), never hand out its map.
            and (m.signed or not self._signed_only or m.identity != self.identity)
        ]
        verdict = decide(
            Candidate(self.node_id, self.identity, self.serving),
            [Candidate(str(m.node_id), m.identity, m.serving) for m in comparable if m.identity],
            refused=self._status is _Status.REFUSED,
        )
        self._judge(answered, verdict.winner)
        if verdict.admitted:
            self._admit(answered)
        elif verdict.winner != self.identity:
            self._refuse(verdict.winner, comparable)
        # else: refused before, with no serving peer of its own identity to rejoin: stays so.
        if (self._status, self._map) != before:
            changed, self._changed = self._changed, asyncio.Event()
            changed.set()
            for listener in self.map_listeners:
                listener(self._map)

    def _judge(self, answered: list[Member], winner: NodeIdentity) -> None:
        """Set each answering peer's ``conflict``; log it once if this node wins."""
        winners = sorted(str(m.node_id) for m in answered if m.identity == winner)
        witness = self.node_id if winner == self.identity else (winners or ["?"])[0]
        for m in answered:
            # This warehouse holds the keys of its own cluster's nodes only (open clusters
            # still hear, unsigned, the cluster that refuses this node).
            own = m.identity == self.identity
            if not m.proven:
                conflict: str | None = (
                    f"node {m.node_id} at {m.address} did not prove it holds the peer secret; "
                    "start every node with the same --peer-token-file (or, under mutual TLS, "
                    "give each a certificate with the peer role)"
                )
            elif m.claimed is not None and m.claimed != m.address:
                conflict = (
                    f"node {m.node_id} answers at {m.address} but says it is reached at "
                    f"{m.claimed}; list each node in --peers by its --advertise address (an "
                    "answer relayed from another address looks like this too)"
                )
            elif m.identity is None:
                conflict = (
                    f"node {m.node_id} at {m.address} answered without a valid cluster identity; "
                    "run the same deltaflow version on every node"
                )
            elif m.node_id == self.node_id:
                conflict = (
                    f"node id {self.node_id} answers at {self.address} and at {m.address}; "
                    "unless both are addresses of this node, give each node its own --node-id"
                )
            elif m.identity != winner:
                conflict = refusal_message(str(m.node_id), m.identity, witness, winner)
            elif not m.signed and self._keys_checked and (self._signed_only or own):
                conflict = (
                    f"the node at {m.address} did not prove it is node {m.node_id}: no key of "
                    f"{m.node_id} in the warehouse matches its answer's signature (each node "
                    f"publishes its key in {NODE_KEYS_DIR}/ at start; the peer token alone "
                    "cannot answer as a node)"
                )
            else:
                conflict = None
            if conflict and conflict != m.conflict and winner == self.identity:
                log.error("%s", conflict)
            m.conflict = conflict

    def _admit(self, answered: list[Member]) -> None:
        if self._status is _Status.REFUSED:
            log.info("node %s admitted again: %s", self.node_id, self.identity.describe())
        self._status, self._refusal, self._refused_by = _Status.ADMITTED, None, None
        live = {} if self._leaving else {self.node_id: self.address}
        for m in answered:
            if m.node_id and not (m.conflict or m.own_refusal):
                live[m.node_id] = m.address
        if not live:  # draining with no live peer: no one to hand the partitions to
            return
        if self._own_map and dict(self._map.addresses) == live:
            return
        self._own_map = True
        version = max(_now_ms(), self._map.version + 1)
        before = set(self._map.addresses)
        self._map = PartitionMap.build(version, live, self.partitions)
        event(log, "membership.changed", f"partition map v{version}: members {sorted(live)}",
              version=version, members=sorted(live), joined=sorted(set(live) - before),
              left=sorted(before - set(live)))  # fmt: skip

    def _refuse(self, winner: NodeIdentity, comparable: list[Member]) -> None:
        # Winners that serve their own map first: theirs is the map to hand out.
        winners = sorted(
            (m for m in comparable if m.identity == winner),
            key=lambda m: (m.own_refusal is not None, str(m.node_id)),
        )
        if self._refused_by != winner:
            self._refusal = refusal_message(
                self.node_id, self.identity, str(winners[0].node_id), winner
            )
            log.error("%s", self._refusal)
        self._status, self._refused_by = _Status.REFUSED, winner
        # Hand out the winners' map, so a client that reached this node finds the owners.
        maps: list[PartitionMap] = []
        for m in winners:
            if (
                m.own_refusal is None
                and isinstance(m.map_wire, dict)
                and (m.signed or not self._signed_only)
            ):
                with contextlib.suppress(ValueError):
                    maps.append(PartitionMap.from_wire(m.map_wire))
        newest = max(maps, key=lambda p: p.version, default=None)
        if newest is not None and (self._own_map or newest.version != self._map.version):
            self._own_map = False
            self._map = newest


def _now_ms() -> int:
    return time.time_ns() // 1_000_000
