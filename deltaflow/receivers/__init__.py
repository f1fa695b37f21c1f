"""Server-side receivers: the base class, the allow-list registry and built-in receivers."""

from .base import Receiver, ReceiverContext, TableHandle
from .dead_letter import DeadLetter
from .registry import ReceiverRegistry
from .table import TableUpsert

__all__ = [
    "DeadLetter",
    "Receiver",
    "ReceiverContext",
    "ReceiverRegistry",
    "TableHandle",
    "TableUpsert",
]
