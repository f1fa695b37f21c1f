"""Whether an object store honours conditional writes, the property every commit to a table
on it relies on: with no lock any two hosts share, a Delta commit is safe only if creating
``_delta_log/<version>.json`` fails when another writer created it first.

The check writes a few small objects under ``<uri>/.deltaflow/checks/<random>/`` and deletes
them: a create of an existing key must be refused, a write conditional on a stale ETag must be
refused, and of ``racers`` writers creating one key at once exactly one must win.
"""

from __future__ import annotations

import os
import re
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from ..errors import UsageError
from .stores import is_secret_option, open_store

__all__ = [
    "ConditionalWriteCheck",
    "check_conditional_writes",
    "first_line",
    "require_conditional_writes",
    "store_errors",
]


@dataclass(frozen=True, slots=True)
class ConditionalWriteCheck:
    """What the store did.

    Attributes:
        uri: the store location checked.
        create_refused: a create (``If-None-Match: *``) of an existing key was refused.
        stale_etag_refused: an overwrite conditional on a stale ETag (``If-Match``) was refused.
        racers: writers that raced to create one key.
        winners: how many of them the store let create it (must be 1).
    """

    uri: str
    create_refused: bool
    stale_etag_refused: bool
    racers: int
    winners: int

    @property
    def ok(self) -> bool:
        return self.create_refused and self.stale_etag_refused and self.winners == 1

    def problems(self) -> list[str]:
        """What is wrong, each in a sentence (empty when :attr:`ok`)."""
        found = []
        if not self.create_refused:
            found.append("a create of an existing key (If-None-Match: *) overwrote it")
        if not self.stale_etag_refused:
            found.append("a write conditional on a stale ETag (If-Match) was accepted")
        if self.winners != 1:
            found.append(f"{self.winners} of {self.racers} racing creates of one key succeeded")
        return found

    def refusal(self) -> str:
        """Why tables must not be written on this store (when it is not :attr:`ok`)."""
        return (
            f"the store {self.uri} does not honour conditional writes, so commits to tables on "
            "it could be lost: " + "; ".join(self.problems())
        )


def require_conditional_writes(uri: str, options: Mapping[str, str] | None = None) -> None:
    """Blocking: check the store (:func:`check_conditional_writes`) before writing tables on it.

    Raises:
        UsageError: it does not honour conditional writes, or cannot be reached.
    """
    try:
        check = check_conditional_writes(uri, options)
    except store_errors() as exc:
        raise UsageError(f"cannot reach the store {uri}: {first_line(exc, options)}") from exc
    if not check.ok:
        raise UsageError(
            check.refusal() + " (`deltaflow store check` tells what it does; a store with "
            "strongly consistent conditional PUTs, such as S3, MinIO or versitygw, is needed)"
        )


def store_errors() -> tuple[type[BaseException], ...]:
    """What reaching a store can raise: obstore's errors, and the ``FileNotFoundError`` (a
    missing bucket) and other ``OSError`` some of them are instead."""
    from obstore.exceptions import BaseError

    return (BaseError, OSError)


def first_line(exc: BaseException, options: Mapping[str, str] | None = None) -> str:
    """An object-store error, short: the store's own code and message when its answer holds
    them (``404 Not Found: NoSuchBucket: The specified bucket does not exist``), else the
    first line, which names the problem (the rest is debug detail), with what the debug
    detail holds that the line leaves out: the connection's own error (``Connection refused
    at 127.0.0.1:9000``), the variable or option a value that is not a boolean came from."""
    text = str(exc).strip()
    code, message = _XML_CODE.search(text), _XML_MESSAGE.search(text)
    if code and message:
        status = _STATUS.search(text)
        prefix = f"{status.group(1)}: " if status else ""
        return f"{prefix}{code.group(1)}: {message.group(1).rstrip('.')}"
    line = text.splitlines()[0] if text else type(exc).__name__
    if "builder error" in line and "http://" in text:
        line += " (an http:// endpoint needs AWS_ALLOW_HTTP=true among the storage options)"
    connect = _CONNECT.search(text)
    if connect is not None:
        causes = _OS_MESSAGE.findall(text)
        why = causes[-1] if causes else connect.group(1)
        line += f": {why} at {connect.group(2)} (is the store running there? the endpoint is "
        line += "AWS_ENDPOINT_URL or the endpoint storage option)"
    boolean = _NOT_BOOLEAN.search(text)
    if boolean is not None:
        value = boolean.group(1)
        # Settings holding that value, secrets never named; those that are switches first.
        holding = {
            name
            for name, given in [*os.environ.items(), *(options or {}).items()]
            if given == value
            and name.upper().startswith(_STORE_VARIABLES)
            and not is_secret_option(name)
        }
        switches = {n for n in holding if any(w in n.upper() for w in _SWITCH_WORDS)}
        if switches or holding:
            named = ", ".join(f"{name}={value!r}" for name in sorted(switches or holding))
            line += f" ({named}: set true or false, or unset it)"
    return line


_CONNECT: Final = re.compile(r'ConnectError\(\s*"([^"]{1,100})",\s*([^\s,]{1,200}),')
_OS_MESSAGE: Final = re.compile(r'message: "([^"]{1,200})"')
_NOT_BOOLEAN: Final = re.compile(r'failed to parse "([^"]{0,100})" as boolean')
#: Where object_store's settings come from: these variables, and storage options by the
#: same names.
_STORE_VARIABLES: Final = ("AWS_", "GOOGLE_", "AZURE_", "OBJECT_STORE_")
#: Words in the names of object_store's true-or-false settings (ALLOW_HTTP, SKIP_SIGNATURE,
#: USE_EMULATOR, DISABLE_TAGGING, VIRTUAL_HOSTED_STYLE_REQUEST, S3_EXPRESS...).
_SWITCH_WORDS: Final = (
    "ALLOW",
    "SKIP",
    "USE_",
    "DISABLE",
    "VIRTUAL_HOSTED",
    "EXPRESS",
    "UNSIGNED",
    "IMDSV1",
    "PAYER",
)
_XML_CODE: Final = re.compile(r"<Code>([^<]{1,100})</Code>")
_XML_MESSAGE: Final = re.compile(r"<Message>([^<]{1,300})</Message>")
_STATUS: Final = re.compile(r"status code: (\d{3}[A-Za-z ]{0,40}?)(?::|$)", re.MULTILINE)


def check_conditional_writes(
    uri: str, options: Mapping[str, str] | None = None, *, racers: int = 16
) -> ConditionalWriteCheck:
    """Blocking: check the store at ``uri`` (see the module docstring).

    Raises:
        obstore.exceptions.BaseError: the store could not be reached or written at all.
    """
    import obstore
    from obstore.exceptions import AlreadyExistsError, PreconditionError

    store = open_store(uri, options)
    base = f".deltaflow/checks/{uuid.uuid4().hex}"
    paths = [f"{base}/created", f"{base}/raced"]
    # Only what was written is deleted after: a store that cannot be reached fails at once,
    # not after each delete has run through the client's retries too.
    written: list[str] = []
    try:
        first = obstore.put(store, paths[0], b"1", mode="create")
        written.append(paths[0])
        try:
            obstore.put(store, paths[0], b"2", mode="create")
            create_refused = False
        except AlreadyExistsError:
            create_refused = True
        # The key now holds "1" (or "2" on a store that overwrote): make its ETag stale first.
        current = obstore.put(store, paths[0], b"3", mode="overwrite")
        stale = first["e_tag"] if first["e_tag"] != current["e_tag"] else "stale-etag"
        try:
            obstore.put(store, paths[0], b"4", mode={"e_tag": stale})
            stale_etag_refused = False
        except PreconditionError:
            stale_etag_refused = True
        winners = _race(store, paths[1], racers)
        if winners:
            written.append(paths[1])
    finally:
        for path in written:
            try:
                obstore.delete(store, path)
            except Exception:  # noqa: BLE001 - best effort: a few bytes under .deltaflow/checks
                pass
    return ConditionalWriteCheck(uri, create_refused, stale_etag_refused, racers, winners)


def _race(store: Any, path: str, racers: int) -> int:
    """How many of ``racers`` threads, released at once, create ``path``."""
    import obstore
    from obstore.exceptions import BaseError

    start = threading.Barrier(racers)
    won: list[int] = []

    def racer(i: int) -> None:
        start.wait()
        try:
            obstore.put(store, path, str(i).encode(), mode="create")
            won.append(i)
        except BaseError:  # refused: already exists, or S3's 409 for a create in progress
            pass

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(racers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return len(won)
