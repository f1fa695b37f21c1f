"""How a node (or an operator's command) calls a peer: ``POST /v1/peer/<op>`` with a proof of
the peer secret that sends no secret (see :mod:`.peer_gate` for the called side).

Each call answers the challenge the called node issued: an HMAC of it, the operation, a fresh
nonce and the caller's name (:func:`deltaflow.security.call_proof`). A call without a
challenge, or with a stale one, is answered 401 with a new challenge and made once more. Every
answer carries the next challenge, so a steady poll is one round trip. The answer must prove
the secret in turn (an HMAC of the nonce), or under mutual TLS without a peer token present a
certificate with the peer role. A node signs its calls with its key (:class:`.identity.NodeKey`)
over what the proof covers; a commit goes with its proof in headers, over its body's digest,
and is sent empty while no challenge is known (a called node reads no unproven body). A node
signs its answers in turn, over their exact bytes and this call's nonce: the answer is
``signed`` when the key the warehouse holds for the node it names checks (:class:`.PeerKeys`),
so the peer secret alone cannot answer as a node. What the answers mean is :mod:`.topology`'s
to decide.
"""

from __future__ import annotations

import asyncio
import enum
import hashlib
import hmac
import json
import secrets
import ssl
from dataclasses import dataclass
from typing import Any, Final

import aiohttp

from .._faults import unreachable, unreachable_commits
from ..security import NODE_ID, answer_proof, call_proof, has_peer_role, url
from .identity import NodeIdentity, NodeKey, PeerKeys
from .peer_gate import (
    ANSWER_SIGNATURE_HEADER,
    CALL_HEADERS,
    PROOF_HEADER,
    answer_message,
    body_digest,
    call_message,
    read_bounded,
)
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
    signed: bool = False  # signed by the node its ``node`` names, with the warehouse's key


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
    signed: bool = False  # signed by ``node_id``'s key in the warehouse (unchecked: False)


class PeerClient:
    """Calls to peers (``https`` when ``tls`` is set).

    Args:
        node_id, address: the caller, as the called node is told (and logs).
        secret: the peer secret calls prove and answers must prove; None: none is set.
        certificates: without a secret, the called node must present a certificate with the
            peer role (mutual TLS); False: it need not.
        tls: the SSL context peers are reached over; None: plain ``http``.
        timeout: seconds each call may take.
        signer: the caller's signing key (a node's); None: calls are not signed (an
            operator's).
        keys: the warehouse's node keys, which answers' signatures are checked with; None:
            none is (every answer is unsigned).
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
        signer: NodeKey | None = None,
        keys: PeerKeys | None = None,
    ) -> None:
        self._node_id = node_id
        self._signer = signer
        self._keys = keys
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
        self,
        address: str,
        op: str,
        *,
        payload: str = "",
        body: bytes | None = None,
        timeout: float | None = None,
    ) -> PeerReply:
        """``POST /v1/peer/<op>`` (or ``/v1/<op>`` for ``drain``) at ``address``, proven;
        ``payload`` (a JSON text) goes with it, under the proof; or ``body`` is the call's
        body, its proof in headers over its digest (a commit). ``timeout``: seconds this call
        may take, else the client's.

        Raises:
            aiohttp.ClientError, OSError, TimeoutError, ValueError, TypeError: no usable
                answer.
        """
        assert self._session is not None
        if op == "commit" and unreachable_commits(address):  # a one-way cut, injected
            raise TimeoutError(f"the commit call to {address} went unanswered")
        path = "/v1/drain" if op == "drain" else f"/v1/peer/{op}"
        proving = bool(self._secret or self._signer)
        for attempt in range(2):
            nonce = secrets.token_hex(16)
            challenge = self._challenges.pop(address, "")
            # (aiohttp takes an explicit None as "no timeout": give one only when asked.)
            options: dict[str, Any] = {}
            if timeout is not None:
                options["timeout"] = aiohttp.ClientTimeout(total=timeout)
            if body is not None:
                # Without a challenge the body would be refused unread: ask for one first.
                data = body if challenge or not proving else b""
                options["data"] = data
                options["headers"] = self._headers(op, challenge, nonce, body_digest(data))
            else:
                options["json"] = self._body(op, challenge, nonce, payload)
            async with self._session.post(
                url(address, path, self._tls),
                ssl=self._tls if self._tls is not None else True,
                **options,
            ) as resp:
                certificate = _peer_certificate(resp)
                answered = await read_bounded(resp.content, MAX_PEER_ANSWER_BYTES)
                status, proof = resp.status, resp.headers.get(PROOF_HEADER)
                signature = resp.headers.get(ANSWER_SIGNATURE_HEADER)
                starting = status == 503 and resp.headers.get(STARTING_HEADER) == "1"
            if answered is None:
                raise ValueError(f"the answer of {address} exceeds {MAX_PEER_ANSWER_BYTES} bytes")
            try:
                answer = json.loads(answered) if answered else {}
            except RecursionError:
                raise ValueError(f"the answer of {address} nests too deep") from None
            if not isinstance(answer, dict):
                raise TypeError(f"the answer of {address} is not a JSON object")
            fresh = answer.get("challenge")
            if isinstance(fresh, str) and len(fresh) <= 96:
                self._challenges[address] = fresh
            if status == 401 and fresh and attempt == 0 and proving:
                continue  # answered with a challenge: prove it
            proven = self._proven(answered, proof, nonce, certificate)
            signed = await self._signed(answer.get("node"), nonce, answered, signature)
            return PeerReply(status, answer, proven, starting, signed)
        return PeerReply(status, answer, False)

    def _proof(
        self, op: str, challenge: str, nonce: str, covered: str, digest: str
    ) -> dict[str, str]:
        """The HMAC (over ``covered``) and the signature (over ``digest``) of a call, as far
        as this client can give them."""
        out: dict[str, str] = {}
        if not challenge:
            return out
        if self._secret:
            out["proof"] = call_proof(
                self._secret, op, challenge, nonce, self._node_id, self._address, covered
            )
        if self._signer is not None:
            message = call_message(op, challenge, nonce, self._node_id, self._address, digest)
            out["signature"] = self._signer.sign(message)
        return out

    def _body(self, op: str, challenge: str, nonce: str, payload: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "node": self._node_id,
            "address": self._address,
            "nonce": nonce,
            "challenge": challenge,
            "proof": None,
        }
        if payload:
            body["payload"] = payload
        digest = hashlib.sha256(payload.encode()).hexdigest()
        body.update(self._proof(op, challenge, nonce, payload, digest))
        return body

    def _headers(self, op: str, challenge: str, nonce: str, digest: str) -> dict[str, str]:
        # The HMAC covers the digest as its payload (the called node has no body yet).
        fields = {"node": self._node_id, "address": self._address, "nonce": nonce}
        fields |= {"digest": digest, "challenge": challenge}
        fields |= self._proof(op, challenge, nonce, digest, digest)
        return {CALL_HEADERS[name]: value for name, value in fields.items() if value}

    def _proven(self, data: bytes, proof: str | None, nonce: str, certificate: Any) -> bool:
        if self._secret:
            return proof is not None and hmac.compare_digest(
                proof, answer_proof(self._secret, nonce, data)
            )
        return has_peer_role(certificate) if self._certificates else True

    async def _signed(self, node_id: Any, nonce: str, data: bytes, signature: str | None) -> bool:
        """Whether ``data`` is signed by the node it names, with the key the warehouse holds."""
        if self._keys is None or not (
            isinstance(node_id, str) and NODE_ID.fullmatch(node_id) and signature is not None
        ):
            return False
        message = answer_message(node_id, nonce, data)
        return await self._keys.verify(node_id, message, signature[:256])

    async def poll(self, address: str) -> Answer | Silence:
        """The peer's answer to a liveness poll, or why there is none."""
        if unreachable(address):  # a network partition, injected
            await asyncio.sleep(self._timeout / 2)
            return Silence.NO_ANSWER
        try:
            reply = await self.call(address, "poll")
            if reply.status == 503 and reply.starting:
                return Silence.STARTING
            # A proven 401 to a poll introduces a node that cannot check this one's key (one
            # of another warehouse): who it is, no map, so this node can be refused by it.
            introduced = reply.status == 401 and reply.proven and "identity" in reply.body
            if reply.status != 200 and not introduced:
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
            map_wire=None if introduced else body.get("map"),
            draining=body.get("draining") is True,
            receivers=_receivers(body.get("receivers")),
            proven=reply.proven,
            signed=reply.signed,
        )

    async def tell_leaving(self, address: str, node_id: str | None = None) -> bool:
        """Tell the peer (``node_id``, when known) this node drains; True if it took this
        node's partitions at once (it checks with a poll of its own that this node says it
        drains). With :class:`.PeerKeys`, only that node's signed answer counts."""
        try:
            reply = await self.call(address, "leave")
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, TypeError):
            return False
        if self._keys is not None and not (
            reply.signed and node_id in (None, reply.body.get("node"))
        ):
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
