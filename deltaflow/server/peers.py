"""How a node (or an operator's command) calls a peer: ``POST /v1/peer/<op>`` with a proof of
the peer secret that sends no secret (see :mod:`.peer_gate` for the called side).

Each call answers the challenge the called node issued: an HMAC of it, the operation, a fresh
nonce and the caller's name (:func:`deltaflow.security.call_proof`). A call without a
challenge, or with a stale one, is answered 401 with a new challenge and made once more. Every
answer carries the next challenge, so a steady poll is one round trip. The answer must prove
the secret in turn (an HMAC of the nonce), or under mutual TLS without a peer token present a
certificate with the peer role. What the answers mean is :mod:`.topology`'s to decide.
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import json
import secrets
import ssl
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from .._faults import unreachable, unreachable_commits
from ..security import NODE_ID, answer_proof, call_proof, has_peer_role, url
from .identity import NodeIdentity
from .peer_gate import PROOF_HEADER, read_bounded
from .probes import STARTING_HEADER

__all__ = ["MAX_PEER_ANSWER_BYTES", "Answer", "PeerClient", "PeerReply", "Silence"]

#: The largest answer a peer call reads (a map of 65,536 partitions fits many times over).
MAX_PEER_ANSWER_BYTES: Final = 8 * 1024 * 1024


class Silence(enum.Enum):
    NO_ANSWER = "no answer"  # a timeout, an error status, a body that is not an answer
    REFUSED = "connection refused"  # nothing listens at the address
    STARTING = "starting"  # a process listens there, but does not serve yet (restarted)


@dataclass(frozen=True, slots=True)
class PeerReply:
    """What a called node answered, and whether it proved it is a peer."""

    status: int
    body: dict[str, Any]
    proven: bool
    starting: bool = False  # a 503 saying the node is starting (not yet serving)


@dataclass(frozen=True, slots=True)
class Answer:
    node_id: str
    address: str | None  # where it says it is reached (its --advertise)
    identity: NodeIdentity | None
    serving: bool
    refused: str | None
    map_wire: Any
    proven: bool  # proved it holds the peer secret (or the peer role; or none is set)
    draining: bool
    receivers: tuple[str, ...] | None = None  # the receivers it serves (None: not said)


class PeerClient:
    """Calls to peers (``https`` when ``tls`` is set).

    Args:
        node_id, address: the caller, as the called node is told (and logs).
        secret: the peer secret calls prove and answers must prove; None: none is set.
        certificates: without a secret, the called node must present a certificate with the
            peer role (mutual TLS); False: it need not.
        tls: the SSL context peers are reached over; None: plain ``http``.
        timeout: seconds each call may take.
    """

    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        secret: str | None,
        certificates: bool = False,
        tls: ssl.SSLContext | None,
        timeout: float,
    ) -> None:
        self._node_id = node_id
        self._address = address
        self._secret = secret
        self._certificates = certificates and secret is None
        self._tls = tls
        self._timeout = timeout
        self._challenges: dict[str, str] = {}  # address -> the challenge its last answer gave
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> PeerClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(
        self, address: str, op: str, *, payload: str = "", timeout: float | None = None
    ) -> PeerReply:
        """``POST /v1/peer/<op>`` (or ``/v1/<op>`` for ``drain``) at ``address``, proven;
        ``payload`` (a JSON text) goes with it, under the proof. ``timeout``: seconds this
        call may take, else the client's.

        Raises:
            aiohttp.ClientError, OSError, TimeoutError, ValueError, TypeError: no usable
                answer.
        """
        assert self._session is not None
        if op == "commit" and unreachable_commits(address):  # a one-way cut, injected
            raise TimeoutError(f"the commit call to {address} went unanswered")
        path = "/v1/drain" if op == "drain" else f"/v1/peer/{op}"
        for attempt in range(2):
            nonce = secrets.token_hex(16)
            challenge = self._challenges.pop(address, "")
            proof = (
                call_proof(
                    self._secret, op, challenge, nonce, self._node_id, self._address, payload
                )
                if self._secret and challenge
                else None
            )
            body = {
                "node": self._node_id,
                "address": self._address,
                "nonce": nonce,
                "challenge": challenge,
                "proof": proof,
            }
            if payload:
                body["payload"] = payload
            # (aiohttp takes an explicit None as "no timeout": give one only when asked.)
            options: dict[str, Any] = {}
            if timeout is not None:
                options["timeout"] = aiohttp.ClientTimeout(total=timeout)
            async with self._session.post(
                url(address, path, self._tls),
                json=body,
                ssl=self._tls if self._tls is not None else True,
                **options,
            ) as resp:
                certificate = _peer_certificate(resp)
                data = await read_bounded(resp.content, MAX_PEER_ANSWER_BYTES)
                status, proof = resp.status, resp.headers.get(PROOF_HEADER)
                starting = status == 503 and resp.headers.get(STARTING_HEADER) == "1"
            if data is None:
                raise ValueError(f"the answer of {address} exceeds {MAX_PEER_ANSWER_BYTES} bytes")
            try:
                answer = json.loads(data) if data else {}
            except RecursionError:
                raise ValueError(f"the answer of {address} nests too deep") from None
            if not isinstance(answer, dict):
                raise TypeError(f"the answer of {address} is not a JSON object")
            fresh = answer.get("challenge")
            if isinstance(fresh, str) and len(fresh) <= 96:
                self._challenges[address] = fresh
            if status == 401 and fresh and attempt == 0 and self._secret:
                continue  # answered with a challenge: prove it
            proven = self._proven(data, proof, nonce, certificate)
            return PeerReply(status, answer, proven, starting)
        return PeerReply(status, answer, False)

    def _proven(self, data: bytes, proof: str | None, nonce: str, certificate: Any) -> bool:
        if self._secret:
            return proof is not None and hmac.compare_digest(
                proof, answer_proof(self._secret, nonce, data)
            )
        return has_peer_role(certificate) if self._certificates else True

    async def poll(self, address: str) -> Answer | Silence:
        """The peer's answer to a liveness poll, or why there is none."""
        if unreachable(address):  # a network partition, injected
            await asyncio.sleep(self._timeout / 2)
            return Silence.NO_ANSWER
        try:
            reply = await self.call(address, "poll")
            if reply.status == 503 and reply.starting:
                return Silence.STARTING
            if reply.status != 200:
                return Silence.NO_ANSWER
            body = reply.body
            node_id = body["node"]
            if not (isinstance(node_id, str) and NODE_ID.fullmatch(node_id)):
                return Silence.NO_ANSWER
        except aiohttp.ClientConnectorError as exc:
            gone = isinstance(exc.os_error, ConnectionRefusedError)
            return Silence.REFUSED if gone else Silence.NO_ANSWER
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError):
            return Silence.NO_ANSWER
        try:
            identity: NodeIdentity | None = NodeIdentity.from_wire(body.get("identity"))
        except ValueError:
            identity = None
        refused = body.get("refused")
        claimed = body.get("address")
        return Answer(
            node_id=node_id,
            address=claimed if isinstance(claimed, str) else None,
            identity=identity,
            serving=body.get("serving") is True,
            refused=refused[:1000] if isinstance(refused, str) else None,
            map_wire=body.get("map"),
            draining=body.get("draining") is True,
            receivers=_receivers(body.get("receivers")),
            proven=reply.proven,
        )

    async def tell_leaving(self, address: str) -> bool:
        """Tell the peer this node drains; True if it took this node's partitions at once
        (it checks with a poll of its own that this node says it drains)."""
        try:
            reply = await self.call(address, "leave")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, TypeError):
            return False
        return reply.status == 200 and reply.proven and reply.body.get("taken") is True


def _peer_certificate(resp: aiohttp.ClientResponse) -> Any:
    """The verified certificate the called node presented (None over plain HTTP, or if it
    cannot be told: the caller then counts the node unproven, failing closed)."""
    # ``resp.connection`` is gone once a short answer arrived whole; the response keeps the
    # protocol it was read from (aiohttp has no public accessor for the peer's certificate).
    protocol = getattr(resp, "_protocol", None)
    transport = getattr(protocol, "transport", None)
    return transport.get_extra_info("peercert") if transport is not None else None


#: Most receiver names taken from a peer's answer, and their longest (a hostile peer's list
#: is bounded, not trusted beyond telling clients where a receiver is served).
MAX_PEER_RECEIVERS: Final = 256
MAX_RECEIVER_NAME: Final = 256


def _receivers(given: Any) -> tuple[str, ...] | None:
    if not isinstance(given, list):
        return None
    return tuple(
        name
        for name in given[:MAX_PEER_RECEIVERS]
        if isinstance(name, str) and 0 < len(name) <= MAX_RECEIVER_NAME
    )
