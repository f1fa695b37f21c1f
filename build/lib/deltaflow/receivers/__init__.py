"""Server-side receivers: the base class, the allow-list registry and built-in receivers."""

from .base import Receiver, ReceiverContext, TableHandle
from .dead_letter import DeadLetter
from .registry import ReceiverRegistry
from .side_input import MAX_SIDE_INPUT_BYTES, SideInput
from .table import TableUpsert

__all__ = [
    "MAX_SIDE_INPUT_BYTES",
    "DeadLetter",
    "Receiver",
    "ReceiverContext",
    "ReceiverRegistry",
    "SideInput",
    "TableHandle",
    "TableUpsert",
]
