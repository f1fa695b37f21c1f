"""Who may call a node's peer endpoints (``/v1/peer/poll``, ``/v1/peer/leave``,
``/v1/drain``): nodes of the cluster and operators, never a client (see
``docs/security.md``, "Roles").

A caller proves the peer secret by answering a challenge this node issued (:mod:`.peers` is
the calling side); under mutual TLS without a peer token, its certificate must carry the peer
role instead. A cluster with neither (on loopback, without any token) admits every local
caller, as it always did. A node's calls are also signed with its key, which the warehouse
holds (:class:`.identity.PeerKeys`): a call that acts as a node (a commit) must carry the
signature of the node it names, so the peer token alone cannot speak as one; so must a poll
or a leave wherever a peer credential is set. A node signs its answers too, over their exact
bytes and the caller's nonce, so the caller can tell which node answered (:mod:`.peers`).
Everything a caller sends is read within a size bound and checked against fixed patterns
before it is used.

A commit call carries its proof in headers, over the digest of its body: a caller that does
not prove itself is refused before a byte of the body is read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import StreamReader, web

from ..security import NODE_ID, Challenges, answer_proof, call_proof, has_peer_role
from .identity import NodeKey, PeerKeys

__all__ = [
    "ANSWER_SIGNATURE_HEADER",
    "CALL_HEADERS",
    "MAX_PEER_CALL_BYTES",
    "MEMBER_OPS",
    "PROOF_HEADER",
    "SIGNED_OPS",
    "Caller",
    "PeerGate",
    "answer_message",
    "body_digest",
    "call_message",
    "read_bounded",
]

log = logging.getLogger(__name__)

#: The largest body a peer call may have (it holds a few short strings).
MAX_PEER_CALL_BYTES: Final = 4096
#: What a caller's address may look like: ``host:port``, an IPv6 host in brackets.
_ADDRESS: Final = re.compile(r"[A-Za-z0-9._\[\]:-]{1,300}")
_NONCE: Final = re.compile(r"[0-9a-f]{32}")
_DIGEST: Final = re.compile(r"[0-9a-f]{64}")
_SIGNATURE: Final = re.compile(r"[0-9a-f]{128}")
#: The header that carries a called node's proof of its answer's bytes.
PROOF_HEADER: Final = "X-Deltaflow-Proof"
#: The header that carries a called node's signature of its answer (:func:`answer_message`).
ANSWER_SIGNATURE_HEADER: Final = "X-Deltaflow-Answer-Signature"
#: Where a call proven in headers (a commit) carries each field of its proof.
CALL_HEADERS: Final = {
    "node": "X-Deltaflow-Node",
    "address": "X-Deltaflow-Address",
    "nonce": "X-Deltaflow-Nonce",
    "challenge": "X-Deltaflow-Challenge",
    "proof": "X-Deltaflow-Call-Proof",
    "digest": "X-Deltaflow-Digest",
    "signature": "X-Deltaflow-Signature",
}
#: Calls that act as the node they name: only that node's signature admits them.
SIGNED_OPS: Final = frozenset({"commit"})
#: Calls by which a node makes itself known (a poll is observed, a leave asks for a poll):
#: with a peer credential set, only the named node's signature admits them, so the credential
#: alone cannot join as a node. An open loopback cluster (no credential) admits any local
#: caller anyway, and there a node on another warehouse, whose key this one does not hold,
#: must still be heard to be refused by its cluster identity.
MEMBER_OPS: Final = frozenset({"poll", "leave"})


def body_digest(data: bytes) -> str:
    """The digest a call proven in headers gives of its body (SHA-256, hex)."""
    return hashlib.sha256(data).hexdigest()


def call_message(
    op: str, challenge: str, nonce: str, node_id: str, address: str, digest: str
) -> bytes:
    """What a node signs for a call: what the peer proof covers (the operation, the called
    node's one-use challenge, the caller's nonce, name and address, the payload's digest)."""
    parts = ("deltaflow-peer-signature", op, challenge, nonce, node_id, address, digest)
    return "\0".join(parts).encode()


def answer_message(node_id: str, nonce: str, data: bytes) -> bytes:
    """What a node signs for an answer: its id, the caller's one-use nonce and the answer's
    exact bytes (so an answer serves one call only, and says which node gave it)."""
    return b"\0".join((b"deltaflow-peer-answer", node_id.encode(), nonce.encode(), data))


async def read_bounded(content: StreamReader, limit: int) -> bytes | None:
    """A whole body, or None once it passes ``limit`` bytes (read no further)."""
    parts: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Caller:
    """A peer (or operator) whose call was proven: its node id, address and nonce, and the
    payload its proof covers (empty for calls without one)."""

    node_id: str
    address: str
    nonce: str
    payload: str = ""
    digest: str = ""  # of the body, for a call proven in headers
    signed: bool = False  # the node it names signed it (its key in the warehouse)
    #: A poll proven by the peer secret but not signed where signatures are required: the
    #: caller is told who this node is (:meth:`PeerGate.introduce`), nothing more.
    unverified: bool = False

    def __str__(self) -> str:
        return f"{self.node_id}@{self.address}"


class PeerGate:
    """Admits calls to peer endpoints.

    Args:
        node_id: this node (it signs its answers with it).
        secret: the peer secret callers prove; None: none is set.
        certificates: without a secret, callers must present a certificate with the peer role
            (the node requires client certificates: mutual TLS).
        keys: the warehouse's node keys: calls in :data:`SIGNED_OPS` (and, with a secret or
            certificates, :data:`MEMBER_OPS`) must carry the signature of the node they name;
            None: no call is checked for one.
        signer: this node's key, which signs every answer; None: answers are not signed.
    """

    def __init__(
        self,
        *,
        node_id: str,
        secret: str | None,
        certificates: bool,
        keys: PeerKeys | None = None,
        signer: NodeKey | None = None,
    ) -> None:
        self._node_id = node_id
        self._secret = secret
        self._certificates = certificates and secret is None
        self._keys = keys
        self._signer = signer
        self._challenges = Challenges()

    async def admit(
        self, request: web.Request, op: str, *, limit: int = MAX_PEER_CALL_BYTES
    ) -> Caller:
        """The proven caller of ``request``.

        Raises:
            web.HTTPException: 400 malformed, 401 unproven (with a fresh challenge), 403 a
                client's certificate, 413 too large. Its body says what to change.
        """
        data = await read_bounded(request.content, limit)
        if data is None:
            raise web.HTTPRequestEntityTooLarge(
                limit,
                limit + 1,
                text=json.dumps({"error": f"a peer {op} call has at most {limit} bytes"}),
                content_type="application/json",
            )
        try:
            body = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError):
            raise _refuse(web.HTTPBadRequest, "a peer call is a JSON object") from None
        caller = _caller(body)
        if caller is None:
            raise _refuse(
                web.HTTPBadRequest, "a peer call names its node, address and a 32-hex nonce"
            )
        digest = hashlib.sha256(caller.payload.encode()).hexdigest()
        return await self._prove(request, op, caller, body, digest)

    async def admit_unread(self, request: web.Request, op: str, *, limit: int) -> Caller:
        """The proven caller of ``request``, whose proof is in its headers (see
        :data:`CALL_HEADERS`), checked before its body is read; then :meth:`read_proven`.

        Raises:
            web.HTTPException: as :meth:`admit`, and 411 without a length. A refused call's
                body is never read into memory, and its connection is not kept.
        """
        try:
            return await self._admit_unread(request, op, limit)
        except web.HTTPException as exc:
            # Not kept alive: what follows of the refused body is discarded, never buffered.
            exc.force_close()
            raise

    async def _admit_unread(self, request: web.Request, op: str, limit: int) -> Caller:
        length = request.content_length
        if length is None:
            raise _refuse(web.HTTPLengthRequired, f"a peer {op} call says its length")
        if length > limit:
            raise _refuse(
                web.HTTPRequestEntityTooLarge,
                f"a peer {op} call has at most {limit} bytes",
                status=(limit, length),
            )
        fields = {name: request.headers.get(header) for name, header in CALL_HEADERS.items()}
        caller = _caller(fields)
        digest = fields["digest"]
        if caller is None or not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
            raise _refuse(  # unproven: answered with a challenge, as a call without a proof
                web.HTTPUnauthorized,
                f"a peer {op} call names its node, address, a 32-hex nonce and the SHA-256 of "
                f"its body in headers {', '.join(CALL_HEADERS.values())}",
                self._challenges,
            )
        # The HMAC covers the digest as a call's payload: the body is bound before it is read.
        return await self._prove(request, op, caller, fields, digest, payload=digest)

    async def _prove(
        self,
        request: web.Request,
        op: str,
        caller: Caller,
        given: Mapping[str, Any],
        digest: str,
        payload: str | None = None,
    ) -> Caller:
        challenge, proof = given.get("challenge"), given.get("proof")
        fresh = isinstance(challenge, str) and self._challenges.fresh(challenge)
        if self._secret is not None:
            if not fresh:
                raise _refuse(web.HTTPUnauthorized, "answer this challenge", self._challenges)
            assert isinstance(challenge, str)
            expected = call_proof(
                self._secret,
                op,
                challenge,
                caller.nonce,
                caller.node_id,
                caller.address,
                caller.payload if payload is None else payload,
            )
            if not (isinstance(proof, str) and hmac.compare_digest(proof, expected)):
                log.info(
                    "refused a %s call from %s claiming to be %s: wrong peer proof",
                    op,
                    request.remote,
                    caller,
                )
                raise _refuse(
                    web.HTTPUnauthorized,
                    "wrong peer proof: start every node with the same --peer-token-file",
                    self._challenges,
                )
        elif self._certificates and not has_peer_role(_certificate(request)):
            raise _refuse(
                web.HTTPForbidden,
                "this certificate is a client's: peers and operators present one with the peer "
                "role (see docs/security.md)",
            )
        signed = await self._signed(op, caller, given, challenge, digest)
        credentialed = self._secret is not None or self._certificates
        unverified = False
        if op in MEMBER_OPS and credentialed and self._keys is not None and not signed:
            if op != "poll":
                raise self._unsigned(request, op, caller)
            unverified = True  # a node of another warehouse, whose key this one lacks
        if op in SIGNED_OPS and self._keys is not None and not signed:
            raise self._unsigned(request, op, caller)
        if self._secret is not None or signed:
            assert isinstance(challenge, str)
            self._challenges.use(challenge)
        return Caller(
            caller.node_id,
            caller.address,
            caller.nonce,
            caller.payload,
            digest,
            signed=signed,
            unverified=unverified,
        )

    def _unsigned(self, request: web.Request, op: str, caller: Caller) -> web.HTTPException:
        log.info(
            "refused a %s call from %s claiming to be %s: not signed by %s's key",
            op,
            request.remote,
            caller,
            caller.node_id,
        )
        return _refuse(
            web.HTTPUnauthorized,
            f"this {op} call is not signed with the key the warehouse holds for node "
            f"{caller.node_id} (a node signs its own calls; the peer token alone does not "
            "speak for a node)",
            self._challenges,
        )

    async def _signed(
        self, op: str, caller: Caller, given: Mapping[str, Any], challenge: Any, digest: str
    ) -> bool:
        """Whether the call carries the signature of the node it names, over what its proof
        covers (and the challenge this node issued, so it serves once and here only)."""
        signature = given.get("signature")
        if self._keys is None or not (
            isinstance(signature, str)
            and _SIGNATURE.fullmatch(signature)
            and isinstance(challenge, str)
            and self._challenges.fresh(challenge)
        ):
            return False
        message = call_message(op, challenge, caller.nonce, caller.node_id, caller.address, digest)
        return await self._keys.verify(caller.node_id, message, signature)

    async def read_proven(self, request: web.Request, caller: Caller, limit: int) -> bytes:
        """The body of a call :meth:`admit_unread` admitted, read within ``limit`` bytes.

        Raises:
            web.HTTPException: 413 past the limit, 400 when it is not the body the proof
                covers.
        """
        data = await read_bounded(request.content, limit)
        if data is None:
            raise _refuse(
                web.HTTPRequestEntityTooLarge,
                f"a peer call has at most {limit} bytes",
                status=(limit, limit + 1),
            )
        if not hmac.compare_digest(body_digest(data), caller.digest):
            log.info("refused a call from %s: its body is not the one its proof covers", caller)
            raise _refuse(web.HTTPBadRequest, "the body does not match its digest header")
        return data

    def introduce(self, request: web.Request, caller: Caller, who: dict[str, Any]) -> web.Response:
        """The 401 to an ``unverified`` poll, proven and signed as an answer: ``who`` this
        node is (its id, address and cluster identity), so a node on another warehouse,
        whose keys neither side can read, still learns it must refuse itself; no map."""
        refusal = self._unsigned(request, "poll", caller)
        error = json.loads(refusal.text or "{}")["error"]
        response = self.answer(caller, {"error": error, **who})
        response.set_status(401)
        return response

    def answer(self, caller: Caller, body: dict[str, Any]) -> web.Response:
        """``body`` as the answer to ``caller``, with the next challenge, the proof of its
        exact bytes in the ``X-Deltaflow-Proof`` header and this node's signature of them in
        ``X-Deltaflow-Answer-Signature``."""
        body["challenge"] = self._challenges.issue()
        data = json.dumps(body).encode()
        headers = {}
        if self._secret is not None:
            headers[PROOF_HEADER] = answer_proof(self._secret, caller.nonce, data)
        if self._signer is not None:
            message = answer_message(self._signer.node_id, caller.nonce, data)
            headers[ANSWER_SIGNATURE_HEADER] = self._signer.sign(message)
        return web.Response(body=data, content_type="application/json", headers=headers)


def _certificate(request: web.Request) -> Any:
    """The verified certificate the caller presented (None without TLS)."""
    transport = request.transport
    return transport.get_extra_info("peercert") if transport is not None else None


def _caller(body: Any) -> Caller | None:
    if not isinstance(body, Mapping):
        return None
    node_id, address, nonce = body.get("node"), body.get("address"), body.get("nonce")
    payload = body.get("payload", "")
    if not (
        isinstance(node_id, str)
        and NODE_ID.fullmatch(node_id)
        and isinstance(address, str)
        and _ADDRESS.fullmatch(address)
        and isinstance(nonce, str)
        and _NONCE.fullmatch(nonce)
        and isinstance(payload, str)
    ):
        return None
    return Caller(node_id, address, nonce, payload)


def _refuse(
    kind: type[web.HTTPException],
    error: str,
    challenges: Challenges | None = None,
    *,
    status: tuple[int, int] | None = None,
) -> web.HTTPException:
    body: dict[str, str] = {"error": error}
    if challenges is not None:
        body["challenge"] = challenges.issue()
    text, content_type = json.dumps(body), "application/json"
    if status is not None:  # 413 takes the limit and the size it refused
        return web.HTTPRequestEntityTooLarge(*status, text=text, content_type=content_type)
    return kind(text=text, content_type=content_type)
