"""A warehouse location: a local directory (:class:`pathlib.Path`) or a place on an object store
(:class:`StorePath`), behind the one small path API the tables layer uses.

:class:`StorePath` answers the handful of ``Path`` calls that reading and writing a Delta log
needs (``/``, ``name``, ``iterdir``, ``is_dir``, ``read_text``, ``open``, ``unlink``...) with
``obstore`` calls, so the log reader, the lane marks and the merge-on-read writer read a table
on S3 exactly as on disk. ``open("x...")`` is a create-if-absent put (``If-None-Match: *``): the
one conditional write that makes a commit safe without a lock. ``str()`` of a location is the
URI delta-rs opens, and :func:`storage_options` the options it needs with it.
"""

from __future__ import annotations

import fnmatch
import io
import os
import uuid
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TypeAlias
from urllib.parse import urlsplit

from .stores import is_object_store, open_store, redacted

__all__ = [
    "Location",
    "StorePath",
    "create_exclusive",
    "location",
    "open_input",
    "open_output",
    "storage_options",
]


class StorePath:
    """A key (or key prefix, for a "directory") on an object store, used like a ``Path``.

    Blocking: every method that touches the store makes a request (use from worker threads).
    Equal and hashable by URI, so it keys dicts as a ``Path`` does.
    """

    __slots__ = ("_key", "_options", "_root", "_store")

    def __init__(self, root: str, key: str, store: Any, options: Mapping[str, str]) -> None:
        self._root = root  # scheme://bucket
        self._key = key.strip("/")
        self._store = store
        self._options = dict(options)

    @classmethod
    def parse(cls, uri: str, options: Mapping[str, str] | None = None) -> StorePath:
        """The location ``uri`` (``s3://bucket/prefix``), with the store opened at its bucket."""
        parts = urlsplit(uri)
        scheme = "s3" if parts.scheme.lower() == "s3a" else parts.scheme.lower()
        if not parts.netloc:
            raise ValueError(f"{uri!r} names no bucket (expected {scheme}://BUCKET/PREFIX)")
        root = f"{scheme}://{parts.netloc}"
        return cls(root, parts.path, open_store(root, options), options or {})

    # -- Path's naming -------------------------------------------------------------------

    def __truediv__(self, name: str | os.PathLike[str]) -> StorePath:
        child = str(name).strip("/")
        key = f"{self._key}/{child}" if self._key else child
        return StorePath(self._root, key, self._store, self._options)

    def __str__(self) -> str:
        return f"{self._root}/{self._key}" if self._key else self._root

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r}, options={redacted(self._options)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    @property
    def name(self) -> str:
        return self._key.rsplit("/", 1)[-1]

    @property
    def parent(self) -> StorePath:
        return StorePath(self._root, self._key.rpartition("/")[0], self._store, self._options)

    @property
    def storage_options(self) -> dict[str, str]:
        return dict(self._options)

    def with_name(self, name: str) -> StorePath:
        return self.parent / name

    def expanduser(self) -> StorePath:
        return self

    def resolve(self) -> StorePath:
        return self

    def as_uri(self) -> str:
        return str(self)

    # -- reading -------------------------------------------------------------------------

    def iterdir(self) -> Iterator[StorePath]:
        """The objects and "directories" directly under this prefix (none if it is empty)."""
        import obstore

        listed = obstore.list_with_delimiter(self._store, f"{self._key}/" if self._key else None)
        for prefix in listed["common_prefixes"]:
            yield StorePath(self._root, prefix, self._store, self._options)
        for meta in listed["objects"]:
            yield StorePath(self._root, meta["path"], self._store, self._options)

    def names_after(self, start: str) -> list[str]:
        """The names of the objects directly under this prefix that sort after ``start`` (a
        name): a listing that skips what an earlier one saw (the log only grows)."""
        import obstore

        prefix = f"{self._key}/" if self._key else ""
        found = []
        for page in obstore.list(self._store, prefix or None, offset=prefix + start):
            found += [m["path"][len(prefix) :] for m in page]
        return [name for name in found if "/" not in name]

    def glob(self, pattern: str) -> Iterator[StorePath]:
        return (p for p in self.iterdir() if fnmatch.fnmatchcase(p.name, pattern))

    def is_dir(self) -> bool:
        """Whether anything is stored under this prefix (a store has no empty directories)."""
        import obstore

        for page in obstore.list(self._store, f"{self._key}/", chunk_size=1):
            if page:
                return True
        return False

    def is_file(self) -> bool:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.head(self._store, self._key)
        except (NotFoundError, FileNotFoundError):  # obstore raises either, by version
            return False
        return True

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def read_bytes(self) -> bytes:
        """Raises FileNotFoundError when there is no such object."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            return bytes(obstore.get(self._store, self._key).bytes())
        except (NotFoundError, FileNotFoundError) as exc:
            raise FileNotFoundError(f"{self}: no such object") from exc

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def read_tagged(self) -> tuple[bytes, str] | None:
        """The object's bytes and ETag (None if there is no such object)."""
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            got = obstore.get(self._store, self._key)
        except (NotFoundError, FileNotFoundError):
            return None
        etag = got.meta["e_tag"]
        if etag is None:
            raise OSError(f"{self}: the store gave no ETag, so the object cannot be swapped")
        return bytes(got.bytes()), etag

    def open(self, mode: str = "r", encoding: str | None = None) -> Any:
        """``r``/``rb``: the whole object, in memory. ``w``/``wb``: written on close. ``x``/
        ``xb``: created on close only if absent (FileExistsError otherwise)."""
        if "r" in mode:
            data = self.read_bytes()
            return (
                io.BytesIO(data) if "b" in mode else io.StringIO(data.decode(encoding or "utf-8"))
            )
        exclusive = "x" in mode
        raw = _PutOnClose(self, exclusive=exclusive)
        return raw if "b" in mode else io.TextIOWrapper(raw, encoding=encoding or "utf-8")

    # -- writing -------------------------------------------------------------------------

    def write_bytes(self, data: bytes) -> int:
        import obstore

        obstore.put(self._store, self._key, data)
        return len(data)

    def write_text(self, text: str, encoding: str = "utf-8") -> int:
        return self.write_bytes(text.encode(encoding))

    def create(self, data: bytes) -> dict[str, Any]:
        """Store ``data`` only if no object has this key (``If-None-Match: *``); the put's
        result (``e_tag``, ``version``).

        Raises:
            FileExistsError: another writer created it first.
        """
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        try:
            return dict(obstore.put(self._store, self._key, data, mode="create"))
        except (AlreadyExistsError, PreconditionError, FileExistsError) as exc:
            raise FileExistsError(f"{self} exists") from exc

    def replace_if(self, data: bytes, etag: str | None) -> bool:
        """Store ``data`` only if the object still has ETag ``etag`` (``If-Match``; None: only
        if there is no object, ``If-None-Match: *``). False when another writer changed it."""
        import obstore
        from obstore.exceptions import AlreadyExistsError, PreconditionError

        mode: Any = "create" if etag is None else {"e_tag": etag}
        try:
            obstore.put(self._store, self._key, data, mode=mode)
        except (AlreadyExistsError, PreconditionError, FileExistsError):
            return False
        return True

    def rename(self, target: StorePath) -> StorePath:
        """Move the object to ``target`` on the same store (a copy, then a delete)."""
        import obstore

        obstore.rename(self._store, self._key, target._key)
        return target

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: a store has no directories."""

    def unlink(self, missing_ok: bool = False) -> None:
        import obstore
        from obstore.exceptions import NotFoundError

        try:
            obstore.delete(self._store, self._key)
        except (NotFoundError, FileNotFoundError):
            if not missing_ok:
                raise FileNotFoundError(f"{self}: no such object") from None


class _PutOnClose(io.BytesIO):
    """A binary file whose content is put to the store when it is closed."""

    def __init__(self, target: StorePath, *, exclusive: bool) -> None:
        super().__init__()
        self._target = target
        self._exclusive = exclusive

    def fileno(self) -> int:  # os.fsync(out.fileno()): the put is the durable write
        raise io.UnsupportedOperation("an object-store write has no file descriptor")

    def close(self) -> None:
        if not self.closed:
            data = self.getvalue()
            super().close()
            if self._exclusive:
                self._target.create(data)
            else:
                self._target.write_bytes(data)


#: A warehouse or a place in one: a local directory, or a prefix on an object store.
Location: TypeAlias = Path | StorePath


def location(
    where: str | os.PathLike[str] | StorePath, options: Mapping[str, str] | None = None
) -> Location:
    """``where`` as a location: an object-store URI (``s3://...``) becomes a :class:`StorePath`
    with ``options`` (delta-rs's storage option names; the environment's ``AWS_*`` variables
    apply too); anything else is a local path."""
    if isinstance(where, StorePath | Path):
        return where
    text = os.fspath(where)
    if is_object_store(text):
        return StorePath.parse(text, options)
    return Path(text)


def storage_options(where: Location) -> dict[str, str] | None:
    """The storage options delta-rs needs to open ``where`` (None for a local path)."""
    return where.storage_options if isinstance(where, StorePath) else None


def create_exclusive(target: Location, data: bytes) -> None:
    """Write ``data`` to ``target`` only if nothing is there, atomically: a reader sees all of
    it or nothing. On disk a hard link of a complete temporary file (POSIX never replaces a
    file by ``link``); on a store a create-if-absent put.

    Raises:
        FileExistsError: another writer created ``target`` first.
    """
    if isinstance(target, StorePath):
        target.create(data)
        return
    staged = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
    staged.write_bytes(data)
    try:
        os.link(staged, target)
    finally:
        staged.unlink(missing_ok=True)


def open_input(source: Location) -> Any:
    """A pyarrow input for reading ``source`` whole (a memory map on disk)."""
    import pyarrow as pa

    if isinstance(source, StorePath):
        return pa.BufferReader(source.read_bytes())
    return pa.memory_map(str(source))  # a str path would be resolved as a URI first


class open_output:
    """A pyarrow sink writing ``target`` (stored when the block ends without an error);
    :attr:`size` is then the bytes written, so that no request asks the store for them."""

    def __init__(self, target: Location) -> None:
        self._target = target
        self._sink: Any = None
        self.size = 0

    def __enter__(self) -> Any:
        import pyarrow as pa

        if isinstance(self._target, StorePath):
            self._sink = pa.BufferOutputStream()
        else:
            self._target.parent.mkdir(parents=True, exist_ok=True)
            self._sink = pa.OSFile(str(self._target), "wb")
        return self._sink

    def __exit__(self, kind: Any, *_: Any) -> None:
        self.size = self._sink.tell()
        if isinstance(self._target, StorePath):
            if kind is None:
                self._target.write_bytes(self._sink.getvalue().to_pybytes())
        else:
            self._sink.close()
