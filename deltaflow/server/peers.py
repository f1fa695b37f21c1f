"""How a node talks to its peers over HTTP: the liveness poll (``GET /v1/cluster``, with the
token, a nonce the answer must prove, and this node's own name) and the call that says it is
leaving (``POST /v1/leave``). What the answers mean is :mod:`.topology`'s to decide."""

from __future__ import annotations

import asyncio
import enum
import hmac
import secrets
import ssl
from dataclasses import dataclass
from typing import Any

import aiohttp

from .._faults import unreachable
from ..security import peer_proof, url
from .identity import NodeIdentity

__all__ = ["Answer", "PeerClient", "Silence"]


class Silence(enum.Enum):
    NO_ANSWER = "no answer"  # a timeout, an error status, a body that is not an answer
    REFUSED = "connection refused"  # nothing listens at the address


@dataclass(frozen=True, slots=True)
class Answer:
    node_id: str
    identity: NodeIdentity | None
    serving: bool
    refused: str | None
    map_wire: Any
    proven: bool  # proved it holds the cluster token (or none is set)
    draining: bool


class PeerClient:
    """This node's calls to its peers (``https`` when ``tls`` is set).

    Args:
        node_id, address: this node, as peers are told (``X-Deltaflow-Peer``).
        token: the cluster token, sent with every call; each answer must prove it.
        tls: the SSL context peers are reached over; None: plain ``http``.
        timeout: seconds each call may take.
    """

    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        token: str | None,
        tls: ssl.SSLContext | None,
        timeout: float,
    ) -> None:
        self._node_id = node_id
        self._address = address
        self._token = token
        self._tls = tls
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self._timeout))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def poll(self, address: str) -> Answer | Silence:
        """The peer's ``/v1/cluster`` answer, or why there is none."""
        assert self._session is not None
        if unreachable(address):  # a network partition, injected
            await asyncio.sleep(self._timeout / 2)
            return Silence.NO_ANSWER
        nonce = secrets.token_hex(16)
        try:
            async with self._session.get(
                url(address, "/v1/cluster", self._tls),
                headers={**self._headers(), "X-Deltaflow-Nonce": nonce},
                ssl=self._tls if self._tls is not None else True,
            ) as resp:
                if resp.status != 200:
                    return Silence.NO_ANSWER
                body = await resp.json()
            node_id = str(body["node"])
        except aiohttp.ClientConnectorError as exc:
            refused = isinstance(exc.os_error, ConnectionRefusedError)
            return Silence.REFUSED if refused else Silence.NO_ANSWER
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError, KeyError, TypeError):
            return Silence.NO_ANSWER
        try:
            identity: NodeIdentity | None = NodeIdentity.from_wire(body.get("identity"))
        except ValueError:
            identity = None
        refused = body.get("refused")
        proof = body.get("proof")
        return Answer(
            node_id=node_id,
            identity=identity,
            serving=body.get("serving") is True,
            refused=refused if isinstance(refused, str) else None,
            map_wire=body.get("map"),
            draining=body.get("draining") is True,
            proven=not self._token
            or (
                isinstance(proof, str)
                and hmac.compare_digest(proof, peer_proof(self._token, nonce, node_id))
            ),
        )

    async def tell_leaving(self, address: str) -> bool:
        """Tell the peer this node drains (it takes this node's partitions at once)."""
        assert self._session is not None
        try:
            async with self._session.post(
                url(address, "/v1/leave", self._tls),
                headers=self._headers(),
                ssl=self._tls if self._tls is not None else True,
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False

    def _headers(self) -> dict[str, str]:
        headers = {"X-Deltaflow-Peer": f"{self._node_id}@{self._address}"}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers
