"""One version of a side input's value: immutable bytes, parsed once per parse function."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Final

from ...errors import SideInputError

__all__ = ["Version"]

#: Parse results cached per version; more parse functions than this parse again.
_PARSE_CACHE: Final = 8


class Version:
    """One immutable version of a side input's value, with its parse results."""

    __slots__ = ("_lock", "_parsed", "data", "name", "sha256", "version")

    def __init__(self, name: str, version: int, data: bytes, sha256: str) -> None:
        self.name = name
        self.version = version
        self.data = data
        self.sha256 = sha256
        # Reentrant: a parse function may itself read a side input.
        self._lock = threading.RLock()
        self._parsed: OrderedDict[Callable[[bytes], Any], tuple[bool, Any]] = OrderedDict()

    def parsed(self, parse: Callable[[bytes], Any]) -> Any:
        """``parse(data)``, computed once per parse function (threads wait for the first)."""
        with self._lock:
            try:
                hit = self._parsed.get(parse)
            except TypeError:
                raise SideInputError(
                    f"parse function {parse!r} for side input {self.name!r} is not hashable"
                ) from None
            if hit is None:
                try:
                    hit = (True, parse(self.data))
                except Exception as exc:  # noqa: BLE001 - user code; reported to every caller
                    hit = (False, exc)
                self._parsed[parse] = hit
                while len(self._parsed) > _PARSE_CACHE:
                    self._parsed.popitem(last=False)
            else:
                self._parsed.move_to_end(parse)
        ok, value = hit
        if ok:
            return value
        raise SideInputError(
            f"parsing side input {self.name!r} version {self.version} "
            f"({len(self.data)} bytes) with {getattr(parse, '__qualname__', parse)!r} failed: "
            f"{type(value).__name__}: {value}"
        ) from value
