"""Who may call a node's peer endpoints (``/v1/peer/poll``, ``/v1/peer/leave``,
``/v1/drain``): nodes of the cluster and operators, never a client (see
``docs/security.md``, "Roles").

A caller proves the peer secret by answering a challenge this node issued (:mod:`.peers` is
the calling side); under mutual TLS without a peer token, its certificate must carry the peer
role instead. A cluster with neither (on loopback, without any token) admits every local
caller, as it always did. Everything a caller sends is read within a size bound and checked
against fixed patterns before it is used.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import StreamReader, web

from ..security import NODE_ID, Challenges, answer_proof, call_proof, has_peer_role

__all__ = ["MAX_PEER_CALL_BYTES", "PROOF_HEADER", "Caller", "PeerGate", "read_bounded"]

log = logging.getLogger(__name__)

#: The largest body a peer call may have (it holds a few short strings).
MAX_PEER_CALL_BYTES: Final = 4096
#: What a caller's address may look like: ``host:port``, an IPv6 host in brackets.
_ADDRESS: Final = re.compile(r"[A-Za-z0-9._\[\]:-]{1,300}")
_NONCE: Final = re.compile(r"[0-9a-f]{32}")
#: The header that carries a called node's proof of its answer's bytes.
PROOF_HEADER: Final = "X-Deltaflow-Proof"


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

    def __str__(self) -> str:
        return f"{self.node_id}@{self.address}"


class PeerGate:
    """Admits calls to peer endpoints.

    Args:
        node_id: this node (it signs its answers with it).
        secret: the peer secret callers prove; None: none is set.
        certificates: without a secret, callers must present a certificate with the peer role
            (the node requires client certificates: mutual TLS).
    """

    def __init__(self, *, node_id: str, secret: str | None, certificates: bool) -> None:
        self._node_id = node_id
        self._secret = secret
        self._certificates = certificates and secret is None
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
        if self._secret is not None:
            challenge, proof = body.get("challenge"), body.get("proof")
            if not (isinstance(challenge, str) and self._challenges.fresh(challenge)):
                raise _refuse(web.HTTPUnauthorized, "answer this challenge", self._challenges)
            expected = call_proof(
                self._secret,
                op,
                challenge,
                caller.nonce,
                caller.node_id,
                caller.address,
                caller.payload,
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
            self._challenges.use(challenge)
        elif self._certificates and not has_peer_role(_certificate(request)):
            raise _refuse(
                web.HTTPForbidden,
                "this certificate is a client's: peers and operators present one with the peer "
                "role (see docs/security.md)",
            )
        return caller

    def answer(self, caller: Caller, body: dict[str, Any]) -> web.Response:
        """``body`` as the answer to ``caller``, with the next challenge, and the proof of
        its exact bytes in the ``X-Deltaflow-Proof`` header."""
        body["challenge"] = self._challenges.issue()
        data = json.dumps(body).encode()
        headers = {}
        if self._secret is not None:
            headers[PROOF_HEADER] = answer_proof(self._secret, caller.nonce, data)
        return web.Response(body=data, content_type="application/json", headers=headers)


def _certificate(request: web.Request) -> Any:
    """The verified certificate the caller presented (None without TLS)."""
    transport = request.transport
    return transport.get_extra_info("peercert") if transport is not None else None


def _caller(body: Any) -> Caller | None:
    if not isinstance(body, dict):
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
    kind: type[web.HTTPException], error: str, challenges: Challenges | None = None
) -> web.HTTPException:
    body: dict[str, str] = {"error": error}
    if challenges is not None:
        body["challenge"] = challenges.issue()
    return kind(text=json.dumps(body), content_type="application/json")
