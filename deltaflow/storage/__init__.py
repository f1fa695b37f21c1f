"""Where tables live: a warehouse is a local directory or an object-store URI
(``s3://bucket/prefix``), and a store must honour conditional writes before nodes commit to
it (:mod:`.conditional`)."""

from __future__ import annotations

from .conditional import ConditionalWriteCheck, check_conditional_writes
from .stores import OBJECT_STORE_SCHEMES, is_object_store, open_store

__all__ = [
    "OBJECT_STORE_SCHEMES",
    "ConditionalWriteCheck",
    "check_conditional_writes",
    "is_object_store",
    "open_store",
]
