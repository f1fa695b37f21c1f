"""Stream keys: the secret that makes a stream belong to the client that opened it.

A node knows a stream by its id, which is public, and by the key it was opened with (see
``docs/security.md``): only a connection that presented the key may feed, close or replay the
stream, and its lane marks in the tables are its own. A stream with a random id gets a random
key. One with a caller-chosen id (a replay after a crash must land in the same lanes) needs a
key the caller can make again: derived from the caller's ``stream_key``, or without one from
the cluster token, which keeps strangers out but not other clients holding the token.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Final

from ..errors import UsageError

__all__ = ["MIN_STREAM_SECRET_BYTES", "STREAM_KEY_BYTES", "stream_key"]

#: The bytes of the key an ``open`` frame carries.
STREAM_KEY_BYTES: Final = 32
#: The shortest ``stream_key=`` a caller may give.
MIN_STREAM_SECRET_BYTES: Final = 16
#: Keys derived for deltaflow streams are never the HMAC of anything else keyed the same way.
_LABEL: Final = b"deltaflow-stream\0"


def stream_key(stream_id: str | None, secret: str | bytes | None, *, token: str | None) -> bytes:
    """The key a stream opens with.

    Args:
        stream_id: the caller's stream id, or None for a random one.
        secret: the caller's ``stream_key`` (only with ``stream_id``), or None.
        token: the cluster token the client holds, or None.

    Returns:
        For a random id, random bytes. For a caller's id,
        ``HMAC-SHA256(secret or token or b"", "deltaflow-stream\\0" + stream_id)``: the same
        for every run under the same id and secret, different for every id.

    Raises:
        UsageError: ``secret`` without ``stream_id``, or not a str or bytes of at least
            ``MIN_STREAM_SECRET_BYTES`` bytes.
    """
    if stream_id is None:
        if secret is not None:
            raise UsageError(
                "stream_key= goes with stream_id=: a stream with a random id has a random key "
                "of its own, and cannot be replayed anyway"
            )
        return secrets.token_bytes(STREAM_KEY_BYTES)
    if secret is None:
        material = (token or "").encode()
    elif isinstance(secret, str | bytes):
        material = secret.encode() if isinstance(secret, str) else bytes(secret)
        if len(material) < MIN_STREAM_SECRET_BYTES:
            raise UsageError(
                f"stream_key= has {len(material)} bytes; use at least {MIN_STREAM_SECRET_BYTES} "
                "(e.g. secrets.token_hex(16)), kept where the replay can read it"
            )
    else:
        raise UsageError(f"stream_key= must be a str or bytes, not {type(secret).__name__}")
    return hmac.new(material, _LABEL + stream_id.encode(), hashlib.sha256).digest()
