"""A peer as one node knows it: what its last answer said, when it was heard, and the state
that makes of it (:mod:`.topology` polls the peers and decides on the map)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Final

from .identity import NodeIdentity
from .peers import Answer, Silence

__all__ = ["DOWN_BECAUSE", "Member", "PeerState", "record"]


class PeerState(enum.StrEnum):
    LIVE = "live"
    DEAD = "dead"  # no answer for failure_timeout
    LEFT = "left"  # no answer for peer_expiry
    REFUSED = "refused"  # answers, but its identity lost (or it says it was refused)
    DRAINING = "draining"  # answers, but is leaving: it handed its partitions over


@dataclass(slots=True)
class Member:
    """A peer as this node knows it (updated after each round of polls)."""

    address: str
    configured: bool = True  # given in ``peers``, rather than learned from its own polls
    node_id: str | None = None
    claimed: str | None = None  # the address its answer says it is reached at
    identity: NodeIdentity | None = None
    serving: bool = False
    own_refusal: str | None = None  # the peer's own ``refused`` message
    conflict: str | None = None  # why this node does not count it, when it answers
    proven: bool = True  # its last answer proved it holds the cluster token
    signed: bool = False  # its last answer was signed with its node id's key in the warehouse
    draining: bool = False  # it said it is leaving (its answer, confirming its leave call)
    receivers: tuple[str, ...] | None = None  # the receivers it serves, as it last said
    map_wire: Any = None
    last_seen: float = 0.0  # monotonic seconds of its last answer; 0 = never
    asked: float = 0.0  # monotonic seconds the poll whose answer is recorded was sent
    since: float = 0.0  # monotonic seconds this node began (or began again) polling it
    suspected: float = 0.0  # monotonic seconds its polls began failing; 0 = not suspected
    first_refusal: float = 0.0  # of the connections refused since it was suspected; 0 = none
    down: float = 0.0  # when refused connections confirmed it down; 0 = not confirmed


#: Why a peer counts as down, by what its polls met.
DOWN_BECAUSE: Final = {
    Silence.REFUSED: "connections refused",
    Silence.STARTING: "a restarted process answers that it is starting",
    Silence.NO_ANSWER: "no answer",
}


def record(member: Member, answer: Answer, asked: float, now: float) -> None:
    """Take ``answer``, to the poll sent at ``asked``, into what ``member`` says."""
    if asked < member.asked:
        # A poll sent before the one already recorded (a leave's confirming poll overtook
        # it): its answer is older news, e.g. "not draining" from before the drain.
        return
    member.asked = asked
    member.node_id = answer.node_id
    member.claimed = answer.address
    member.identity = answer.identity
    member.serving = answer.serving
    member.own_refusal = answer.refused
    member.map_wire = answer.map_wire
    member.proven = answer.proven
    member.signed = answer.signed
    member.draining = answer.draining
    member.receivers = answer.receivers
    member.last_seen = now
    member.suspected = member.first_refusal = member.down = 0.0
