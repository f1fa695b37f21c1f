"""The deltaflow exception tree.

Every error deltaflow raises derives from :class:`DeltaflowError`::

    DeltaflowError
    ├── UsageError                 wrong arguments or state on the caller's side (never retried)
    ├── TransportError             the network between client and node   (retriable)
    │   ├── NodeUnavailableError   no connection could be made to a node
    │   └── ConnectionLostError    an open connection dropped
    ├── TlsError                   TLS between client and node failed: an untrusted certificate,
    │                              a missing client certificate, TLS on one side only
    ├── ProtocolError              a peer broke the wire protocol         (not retriable)
    │   └── FrameTooLargeError     a frame exceeded the agreed size limit
    ├── ServerError                a node reported an error frame (has ``code`` and ``node``)
    │   ├── NotOwnerError          the node does not own the partition   (retriable, refresh map)
    │   ├── OverloadedError        the node is shedding load              (retriable)
    │   ├── CommitConflictError    a Delta commit lost a race             (retriable)
    │   ├── AuthenticationError    wrong or missing token
    │   ├── UnknownReceiverError   receiver name not on the node's allow-list
    │   ├── SchemaError            rows do not fit the table schema
    │   │   └── TableSettingsError     a stream names another key or sequence than the
    │   │                              table's (also a UsageError)
    │   ├── ReceiverError          a receiver raised while applying a batch
    │   └── LaneFailedError        an earlier batch of the same partition failed
    └── DataStreamerError          a stream ended with items not applied (``failed_items``,
        │                          and ``failures``: each with its source position and reason)
        └── StreamUsageError       ... because of how the stream was called (also a UsageError)

Whether an error is retried is decided in one place: the error's ``retriable``, read by
:func:`is_retriable` and sent in the node's ``error`` frames. It is the class's unless a
:class:`ServerError` is built with its own (the node's decision for that one error, as its frame
carries it); either way it is fixed once the error exists. Server errors carry a stable ``code``
(see ``docs/protocol.md``) and :func:`server_error` maps a code back to its class on the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

__all__ = [
    "AuthenticationError",
    "CommitConflictError",
    "ConnectionLostError",
    "DataStreamerError",
    "DeltaflowError",
    "ErrorCode",
    "FailedItem",
    "FrameTooLargeError",
    "ItemFailedError",
    "LaneFailedError",
    "NodeUnavailableError",
    "NotOwnerError",
    "OverloadedError",
    "ProtocolError",
    "ReceiverError",
    "SchemaError",
    "ServerError",
    "SettingsError",
    "SideInputError",
    "StreamUsageError",
    "TableSettingsError",
    "TlsError",
    "TransportError",
    "UnknownReceiverError",
    "UsageError",
    "is_retriable",
    "server_error",
]


class ErrorCode:
    """Stable error codes carried by ``error`` frames. Never renumber; only add."""

    BAD_FRAME = "BAD_FRAME"
    FRAME_TOO_LARGE = "FRAME_TOO_LARGE"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNAUTHORIZED = "UNAUTHORIZED"
    UNKNOWN_RECEIVER = "UNKNOWN_RECEIVER"
    UNKNOWN_STREAM = "UNKNOWN_STREAM"
    NOT_OWNER = "NOT_OWNER"
    OVERLOADED = "OVERLOADED"
    COMMIT_CONFLICT = "COMMIT_CONFLICT"
    SCHEMA_MISMATCH = "SCHEMA_MISMATCH"
    TABLE_SETTINGS = "TABLE_SETTINGS"
    RECEIVER_FAILED = "RECEIVER_FAILED"
    LANE_FAILED = "LANE_FAILED"
    SIDE_INPUT = "SIDE_INPUT"
    ITEM_FAILED = "ITEM_FAILED"
    INTERNAL = "INTERNAL"


class DeltaflowError(Exception):
    """Base of every deltaflow error.

    Attributes:
        retriable: whether resending the same batch may succeed. A class attribute, each
            class's default; a :class:`ServerError` may be built with its own.
    """

    retriable: bool = False

    if not TYPE_CHECKING:  # hidden from mypy, which would then allow any attribute name

        def __setattr__(self, name: str, value: Any) -> None:
            # One decision per error: a handler that wants another builds another error.
            if name == "retriable":
                raise AttributeError(f"{type(self).__name__}.retriable is fixed when it is built")
            super().__setattr__(name, value)


class UsageError(DeltaflowError, ValueError):
    """The caller passed bad arguments or used an object in the wrong state."""


class SettingsError(UsageError):
    """Settings that do not make a valid object: every problem found (``problems``), one per
    line of the message."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class TransportError(DeltaflowError):
    """The connection to a node failed; the batch may be resent."""

    retriable = True


class NodeUnavailableError(TransportError):
    """No connection could be opened to a node."""


class ConnectionLostError(TransportError):
    """An open connection to a node dropped before the answer arrived."""


class TlsError(DeltaflowError):
    """TLS between this client (or node) and a node failed for a reason retrying cannot fix:
    the message says which certificate or setting to change."""


class ProtocolError(DeltaflowError):
    """A peer sent something the wire protocol does not allow."""


class FrameTooLargeError(ProtocolError):
    """A frame (or a single item) is larger than the agreed frame size limit."""


class ServerError(DeltaflowError):
    """An error reported by a node in an ``error`` frame.

    Args:
        retriable: this error's retry decision; None (the default) takes the class's.

    Attributes:
        code: the stable error code (:class:`ErrorCode`).
        node: id of the node that reported it, when known.
        details: extra structured fields sent with the error (e.g. the partition map).
    """

    code: ClassVar[str] = ErrorCode.INTERNAL
    retriable = True  # an unclassified server fault is worth another try

    def __init__(
        self,
        message: str,
        *,
        node: str | None = None,
        details: dict[str, Any] | None = None,
        retriable: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.node = node
        self.details: dict[str, Any] = details or {}
        if retriable is not None:
            self.__dict__["retriable"] = bool(retriable)  # past the guard, once

    def as_final(self) -> ServerError:
        """This error as a final answer: itself if it is not retriable, else a copy that is
        not (same class, message, node and details)."""
        if not self.retriable:
            return self
        final = _restore(type(self), self.args, {**vars(self), "retriable": False})
        final.__cause__ = self.__cause__
        return final

    def __reduce__(self) -> tuple[Any, ...]:
        # Copied and unpickled past __init__ and the guard: the state, retriable included, is
        # put back as it was.
        return (_restore, (type(self), self.args, dict(vars(self))))

    def __str__(self) -> str:
        where = f" (node {self.node})" if self.node else ""
        return f"[{self.code}] {self.args[0]}{where}"


class NotOwnerError(ServerError):
    """The node does not own the batch's partition; refresh the map and resend."""

    code = ErrorCode.NOT_OWNER


class OverloadedError(ServerError):
    """The node is at capacity; back off and resend."""

    code = ErrorCode.OVERLOADED


class CommitConflictError(ServerError):
    """A Delta commit conflicted with a concurrent writer; resend the batch."""

    code = ErrorCode.COMMIT_CONFLICT


class AuthenticationError(ServerError):
    """The node rejected the client's token."""

    code = ErrorCode.UNAUTHORIZED
    retriable = False


class UnknownReceiverError(ServerError):
    """The receiver named by the client is not registered on the node."""

    code = ErrorCode.UNKNOWN_RECEIVER
    retriable = False


class SchemaError(ServerError):
    """Rows of a batch do not fit the target table's schema."""

    code = ErrorCode.SCHEMA_MISMATCH
    retriable = False


class TableSettingsError(SchemaError, UsageError):
    """A write names table settings other than the table's own (its key, its sequence
    columns): the stream's arguments, not its rows, must change."""

    code = ErrorCode.TABLE_SETTINGS
    retriable = False


class ReceiverError(ServerError):
    """The receiver raised while applying a batch."""

    code = ErrorCode.RECEIVER_FAILED
    retriable = False


class LaneFailedError(ServerError):
    """An earlier batch of the same stream partition failed, so later ones are not applied."""

    code = ErrorCode.LANE_FAILED
    retriable = False


class SideInputError(ServerError):
    """A side input is unknown on this node, or has no value yet (see docs/side-inputs.md)."""

    code = ErrorCode.SIDE_INPUT
    retriable = False


class ItemFailedError(ServerError):
    """The receiver marked single items of a batch failed (``ctx.fail``); the rest of the
    batch was applied. ``details["items"]`` lists ``[source position, reason]`` pairs."""

    code = ErrorCode.ITEM_FAILED
    retriable = False


class BadFrameError(ServerError):
    code = ErrorCode.BAD_FRAME
    retriable = False


class FrameTooLargeServerError(ServerError):
    code = ErrorCode.FRAME_TOO_LARGE
    retriable = False


class UnsupportedVersionError(ServerError):
    code = ErrorCode.UNSUPPORTED_VERSION
    retriable = False


class UnknownStreamError(ServerError):
    code = ErrorCode.UNKNOWN_STREAM


@dataclass(frozen=True, slots=True)
class FailedItem:
    """A source item that was not applied, and why.

    Attributes:
        position: the item's index in the source (from 0).
        item: the item as the source gave it.
        reason: what became of it: the error that refused it (naming its column and value
            for a row a table could not take), or why it was never sent.
    """

    position: int
    item: Any
    reason: str


class DataStreamerError(DeltaflowError):
    """A stream ended with items that were not applied.

    Attributes:
        failed_items: exactly the source items that were not applied, in source order.
        failures: the same items as :class:`FailedItem` (source position and reason each), in
            the same order.
        cause: the error that stopped the stream (also chained as ``__cause__``).
    """

    def __init__(
        self,
        message: str,
        failed_items: Sequence[Any],
        cause: BaseException | None,
        failures: Sequence[FailedItem] | None = None,
    ):
        super().__init__(message)
        self.failed_items = list(failed_items)
        self.failures = list(failures) if failures is not None else []
        self.cause = cause


class StreamUsageError(DataStreamerError, UsageError):
    """A stream stopped because of how it was called (a :class:`TableSettingsError`, say):
    a :class:`DataStreamerError` with the items not applied, and a :class:`UsageError`."""


_BY_CODE: dict[str, type[ServerError]] = {
    cls.code: cls
    for cls in (
        ServerError,
        NotOwnerError,
        OverloadedError,
        CommitConflictError,
        AuthenticationError,
        UnknownReceiverError,
        SchemaError,
        TableSettingsError,
        ReceiverError,
        LaneFailedError,
        SideInputError,
        ItemFailedError,
        BadFrameError,
        FrameTooLargeServerError,
        UnsupportedVersionError,
        UnknownStreamError,
    )
}


def server_error(
    code: str,
    message: str,
    *,
    node: str | None = None,
    details: dict[str, Any] | None = None,
    retriable: bool | None = None,
) -> ServerError:
    """Build the most specific :class:`ServerError` for a wire error code (``retriable``: the
    frame's decision; None keeps the class's)."""
    cls = _BY_CODE.get(code, ServerError)
    err = cls(message, node=node, details=details, retriable=retriable)
    if cls is ServerError and code != ErrorCode.INTERNAL:
        err.details.setdefault("code", code)
    return err


def is_retriable(exc: BaseException) -> bool:
    """Whether resending the same batch may succeed (the single retry decision)."""
    return isinstance(exc, DeltaflowError) and exc.retriable


_E = TypeVar("_E", bound=ServerError)


def _restore(cls: type[_E], args: tuple[Any, ...], state: dict[str, Any]) -> _E:
    err = cls.__new__(cls, *args)
    err.args = args
    err.__dict__.update(state)
    return err
