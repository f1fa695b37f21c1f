"""Small records several hosts update safely: read one with its tag, then replace it only if it
still holds what was read (compare-and-swap). On a store the tag is the object's ETag and the
replace a conditional put (``If-Match``, or ``If-None-Match: *`` to create); on disk the tag is
a digest of the content and the replace holds an ``flock`` beside the file while it compares,
then moves a complete file into place. Either way a reader sees a whole old record or a whole
new one, and of two writers that read the same record only one replaces it.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from .flock import file_lock
from .paths import Location, StorePath

__all__ = ["Tagged", "read_tagged", "replace_if_unchanged", "write_whole"]

#: The compare-and-replace on disk holds its lock for one read and one rename; waiting longer
#: than this means a stuck process.
_LOCK_TIMEOUT: Final = 10.0


@dataclass(frozen=True, slots=True)
class Tagged:
    """A record's bytes and the tag a replacement names to be sure nothing changed it since."""

    data: bytes
    tag: str


def read_tagged(source: Location) -> Tagged | None:
    """The record at ``source`` with its tag; None if there is none."""
    if isinstance(source, StorePath):
        found = source.read_tagged()
        return Tagged(*found) if found is not None else None
    try:
        data = source.read_bytes()
    except FileNotFoundError:
        return None
    return Tagged(data, _digest(data))


def replace_if_unchanged(target: Location, data: bytes, expected: Tagged | None) -> bool:
    """Store ``data`` at ``target`` only if it still holds ``expected`` (None: only if there is
    no record yet). False when another writer changed it first (read it again, decide again)."""
    if isinstance(target, StorePath):
        return target.replace_if(data, expected.tag if expected is not None else None)
    with file_lock(
        target.with_name(f".{target.name}.lock"), timeout=_LOCK_TIMEOUT, what=f"{target} lock"
    ):
        now = read_tagged(target)
        if (now and now.tag) != (expected and expected.tag):
            return False
        write_whole(target, data)
    return True


def write_whole(target: Location, data: bytes) -> None:
    """Store ``data`` at ``target`` so that a reader sees all of it or the previous content:
    one put on a store; on disk a complete, synced temporary file renamed into place."""
    if isinstance(target, StorePath):
        target.write_bytes(data)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f".{target.name}.{os.getpid()}-{threading.get_ident()}.tmp")
    try:
        with open(staged, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            Path(staged).unlink()
        raise


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
