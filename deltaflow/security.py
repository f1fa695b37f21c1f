"""Who may talk to a node, and how the bytes are protected: TLS for nodes, peers and clients,
the rule that a node reachable from a network needs a credential, and the proof a peer gives
that it holds the cluster token (see ``docs/security.md``).

Nothing here opens a connection; :mod:`deltaflow.client` and :mod:`deltaflow.server` build
their URLs and SSL contexts from it, so both sides agree on one scheme and one set of rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import hmac
import ipaddress
import logging
import os
import re
import secrets
import shlex
import socket
import ssl
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

from .errors import TlsError, UsageError

__all__ = [
    "CHALLENGE_SECONDS",
    "NODE_ID",
    "PEER_ROLE_URI",
    "Challenges",
    "ClientTls",
    "NodeTls",
    "TlsOption",
    "answer_proof",
    "call_proof",
    "client_context",
    "connect_failure",
    "diagnose",
    "has_peer_role",
    "is_loopback",
    "read_secret",
    "tls_failure",
    "url",
]

#: What a node id may look like: it names the node in maps, logs and peer proofs.
NODE_ID: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: The URI subject alternative name that makes a certificate a peer's (a node's or an
#: operator's) rather than a client's, under mutual TLS without a peer token.
PEER_ROLE_URI: Final = "urn:deltaflow:peer"
#: Seconds a challenge a node issued stays valid (it is used once).
CHALLENGE_SECONDS: Final = 10.0


def _readable(path: str, what: str) -> str:
    """``path``, checked to be a file (settings are checked when they are made, so a typo is
    named at once rather than at the first connection)."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise UsageError(f"{what} {path!r} is not a readable file")
    return path


@dataclass(frozen=True, slots=True)
class NodeTls:
    """A node's TLS: it serves TLS with ``cert``/``key``, verifies peers against ``ca``, and
    with ``client_auth`` requires a certificate signed by ``ca`` from every client and peer
    (mutual TLS). ``ca`` None: the system's trusted roots."""

    cert: str
    key: str
    ca: str | None = None
    client_auth: bool = False

    def __post_init__(self) -> None:
        _readable(self.cert, "--tls-cert")
        _readable(self.key, "--tls-key")
        if self.ca is not None:
            _readable(self.ca, "--tls-ca")
        elif self.client_auth:
            raise UsageError(
                "--tls-client-auth needs --tls-ca: the CA whose certificates clients and peers "
                "must present"
            )

    def server_context(self) -> ssl.SSLContext:
        """What the node's listening socket serves."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=self.ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        context.verify_mode = ssl.CERT_REQUIRED if self.client_auth else ssl.CERT_NONE
        return context

    def peer_context(self) -> ssl.SSLContext:
        """What the node polls its peers with: it verifies their certificates against ``ca``
        and presents its own (a peer under mutual TLS requires it)."""
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert, self.key)
        return context


@dataclass(frozen=True, slots=True)
class ClientTls:
    """What a client needs for TLS, as file paths: it pickles, so it travels to Spark
    executors (an :class:`ssl.SSLContext` does not). ``ca``: the CA that signed the nodes'
    certificates (None: the system's roots); ``cert``/``key``: the client's own certificate,
    for nodes that require one (``--tls-client-auth``)."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise UsageError("ClientTls needs both cert and key, or neither")

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(
            ssl.Purpose.SERVER_AUTH,
            cafile=_readable(self.ca, "the CA file") if self.ca is not None else None,
        )
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        if self.cert is not None and self.key is not None:
            context.load_cert_chain(
                _readable(self.cert, "the client certificate"), _readable(self.key, "the key")
            )
        return context


#: How a client is told to use TLS: a context of its own, the files to build one, or None.
TlsOption: TypeAlias = "ssl.SSLContext | ClientTls | None"


def client_context(tls: ssl.SSLContext | ClientTls | None) -> ssl.SSLContext | None:
    if tls is None or isinstance(tls, ssl.SSLContext):
        return tls
    if isinstance(tls, ClientTls):
        return tls.context()
    raise UsageError(
        f"tls= must be an ssl.SSLContext or a deltaflow.ClientTls, not {type(tls).__name__}"
    )


def url(address: str, path: str, tls: ssl.SSLContext | None) -> str:
    """The URL of ``path`` on the node at ``address`` (``https`` when ``tls`` is set)."""
    return f"{'https' if tls is not None else 'http'}://{address}{path}"


def is_loopback(host: str) -> bool:
    """Whether a node listening on ``host`` can only be reached from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def read_secret(path: str | os.PathLike[str], what: str) -> str:
    """The secret in the file at ``path``, without surrounding whitespace.

    A file its group or other users may read or write is used, with a warning (event
    ``secret.permissions``) that names it and the fix: a refusal would stop the containers
    whose mounted secrets are 0644 or 0444 by default, where no other user shares the host.

    Raises:
        UsageError: the file cannot be read, or holds nothing (an empty secret would let
            anyone in who sends an empty one).
    """
    try:
        with open(path, encoding="utf-8") as file:
            mode = os.fstat(file.fileno()).st_mode  # of the file read, not of a later one
            secret = file.read().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"{what} {os.fspath(path)!r} cannot be read: {exc}") from exc
    if not secret:
        raise UsageError(f"{what} {os.fspath(path)!r} is empty; put the secret in it")
    if os.name == "posix" and mode & 0o077:
        from .logs import event

        name, octal = os.fspath(path), f"{stat.S_IMODE(mode):04o}"
        event(
            _log,
            "secret.permissions",
            f"{what} {name!r} can be read or written by its group or other users (mode "
            f"{octal}): run `chmod 600 {shlex.quote(name)}` (a mounted secret: give its "
            f"volume defaultMode 0400)",
            level=logging.WARNING,
            file=name,
            mode=octal,
            what=what,
        )
    return secret


_log = logging.getLogger(__name__)


def _mac(secret: str, *parts: str) -> str:
    message = "\0".join(parts).encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def call_proof(
    secret: str, op: str, challenge: str, nonce: str, node_id: str, address: str, payload: str = ""
) -> str:
    """What a peer sends to prove it holds the peer secret, without sending it: an HMAC of the
    operation, the challenge the called node issued (used once), the caller's nonce, the
    caller's name and address, and the digest of the call's payload (a prepared commit), so a
    relay cannot alter it. Nothing in it is of use at another node or a second time."""
    digest = hashlib.sha256(payload.encode()).hexdigest()
    return _mac(secret, "deltaflow-peer-call", op, challenge, nonce, node_id, address, digest)


def answer_proof(secret: str, nonce: str, body: bytes) -> str:
    """What a called node answers with to prove it holds the peer secret: an HMAC of the
    caller's random nonce and the answer's exact bytes (its node id, address and every field
    in them), so a relay can neither alter an answer nor pass it off as another's."""
    return _mac(secret, "deltaflow-peer-answer", nonce, hashlib.sha256(body).hexdigest())


def has_peer_role(certificate: Mapping[str, Any] | None) -> bool:
    """Whether a verified certificate (as ``ssl.SSLSocket.getpeercert()`` gives it) names
    :data:`PEER_ROLE_URI`: its holder is a peer or an operator, not only a client."""
    names = (certificate or {}).get("subjectAltName", ())
    return any(kind == "URI" and value == PEER_ROLE_URI for kind, value in names)


class Challenges:
    """Challenges a node issues to callers of its peer endpoints, checked without state.

    A challenge is its issue time, a random part and an HMAC of both under a key only this
    process knows, so issuing one to a stranger costs nothing kept. Only a challenge that a
    valid proof used is remembered (until it expires), so it cannot be used twice.
    """

    def __init__(self, lifetime: float = CHALLENGE_SECONDS) -> None:
        self._key = secrets.token_bytes(32)
        self._lifetime = lifetime
        self._used: dict[str, float] = {}

    def issue(self) -> str:
        stamp = f"{time.monotonic_ns() // 1_000_000}.{secrets.token_hex(8)}"
        return f"{stamp}.{self._sign(stamp)}"

    def fresh(self, challenge: str) -> bool:
        """Whether ``challenge`` was issued here, has not expired and was not used."""
        stamp, _, mac = challenge.rpartition(".")
        issued, _, _ = stamp.partition(".")
        if not (issued.isdigit() and len(challenge) <= 96):
            return False
        if not hmac.compare_digest(mac, self._sign(stamp)):
            return False
        age = time.monotonic() - int(issued) / 1000
        return 0 <= age <= self._lifetime and challenge not in self._used

    def use(self, challenge: str) -> None:
        """Remember ``challenge`` as used (after a valid proof), forgetting expired ones."""
        now = time.monotonic()
        for old in [c for c, at in self._used.items() if now - at > self._lifetime]:
            del self._used[old]
        self._used[challenge] = now

    def _sign(self, stamp: str) -> str:
        return hmac.new(self._key, stamp.encode(), hashlib.sha256).hexdigest()[:32]


def tls_failure(address: str, exc: BaseException, tls: ssl.SSLContext | None) -> TlsError | None:
    """The TLS problem behind a failed connection to ``address``, in words that say what to
    change; None if it was not a TLS problem."""
    cause = getattr(exc, "certificate_error", exc)  # aiohttp wraps the ssl module's error
    text = str(exc)
    if isinstance(cause, ssl.SSLCertVerificationError) or "CERTIFICATE_VERIFY_FAILED" in text:
        detail = getattr(cause, "verify_message", None) or text
        return TlsError(
            f"the certificate of the node at {address} is not trusted ({detail}); pass tls= a "
            "context (or deltaflow.ClientTls(ca=...)) that trusts the CA that signed the "
            "nodes' certificates, and check that the certificate names the host clients use"
        )
    lowered = text.lower()
    # The alerts a node sends when it refuses the client's certificate (TLS 1.3 and 1.2).
    refused = ("certificate required", "certificate_required", "bad certificate", "unknown ca")
    if tls is not None and any(alert in lowered for alert in refused):
        return TlsError(
            f"the node at {address} requires a client certificate (mutual TLS, "
            "--tls-client-auth): pass tls=deltaflow.ClientTls(ca=..., cert=..., key=...) with "
            "a certificate signed by the cluster's CA"
        )
    if tls is not None and ("wrong version number" in lowered or "record layer" in lowered):
        return TlsError(
            f"the node at {address} does not serve TLS; connect without tls=, or start the "
            "node with --tls-cert and --tls-key"
        )
    return None


async def diagnose(
    address: str, tls: ssl.SSLContext | None, timeout: float = 2.0
) -> TlsError | None:
    """Why a connection to ``address`` that dropped without a word failed, if TLS is the
    reason: with ``tls`` None, the node serves TLS (and the plain-text client has sent nothing
    secret yet); with ``tls``, the node closes TLS connections from this client right after
    the handshake, which is what a node requiring a client certificate does under TLS 1.3
    (its refusal comes after the client's side of the handshake, and asyncio's server closes
    without sending the alert)."""
    host, _, port = address.rpartition(":")
    if tls is None:
        probe = ssl.create_default_context()
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE  # only whether it speaks TLS; nothing is sent
    else:
        probe = tls
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host.strip("[]"), int(port), ssl=probe)
            try:
                answer = b"-"
                if tls is not None:
                    writer.write(f"GET /healthz HTTP/1.1\r\nHost: {address}\r\n\r\n".encode())
                    answer = await reader.read(1)
            finally:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()
    except ssl.SSLError as exc:
        return tls_failure(address, exc, tls) if tls is not None else None
    except (OSError, TimeoutError):
        return None
    if tls is not None:
        if answer:
            return None
        return TlsError(
            f"the node at {address} closes TLS connections from this client right after the "
            "handshake: it requires a client certificate (mutual TLS, --tls-client-auth) that "
            "this client did not present or that the node's CA did not sign; pass "
            "tls=deltaflow.ClientTls(ca=..., cert=..., key=...)"
        )
    return TlsError(
        f"the node at {address} serves TLS and this client spoke plain text to it (it sent no "
        "token): pass tls= to deltaflow.connect() (an ssl.SSLContext, or "
        "deltaflow.ClientTls(ca=...)), or --tls-ca on the command line"
    )


def connect_failure(exc: BaseException) -> str:
    """Why a connection could not be made, in the OS's words (aiohttp's own message names
    its TLS setting, ``ssl:default``, even for a plain connection)."""
    error = getattr(exc, "os_error", exc)
    if isinstance(error, socket.gaierror):
        return f"the host name does not resolve ({error.strerror})"
    if isinstance(error, OSError) and error.errno is not None and error.errno > 0:
        hint = " (is a node listening on that port?)" if error.errno == errno.ECONNREFUSED else ""
        return os.strerror(error.errno).lower() + hint
    return str(error) or type(error).__name__
