"""The side-input classes a node serves, imported from the operator's list and checked."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterable

from ...errors import UsageError
from ...receivers.side_input import SideInput
from .schedule import Schedule

__all__ = ["load_side_inputs"]

_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")


def load_side_inputs(names: Iterable[str | type[SideInput]]) -> list[type[SideInput]]:
    """Import side-input classes named ``"module.Class"`` (operator input, trusted) and check
    their name and schedule.

    Raises:
        UsageError: a name cannot be imported, is not a :class:`SideInput` subclass, has a bad
            schedule, or two classes share a side-input name.
    """
    classes: list[type[SideInput]] = []
    seen: dict[str, str] = {}
    for entry in names:
        if isinstance(entry, str):
            module_name, _, attr = entry.rpartition(".")
            if not module_name:
                raise UsageError(f"side input {entry!r} must be a dotted 'module.Class' name")
            try:
                cls = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise UsageError(f"cannot load side input {entry!r}: {exc}") from exc
        else:
            cls = entry
        if not (isinstance(cls, type) and issubclass(cls, SideInput)):
            raise UsageError(f"{entry!r} is not a subclass of deltaflow.receivers.SideInput")
        name = cls.side_input_name()
        if not _NAME.fullmatch(name):
            raise UsageError(
                f"side input name {name!r} ({cls.__qualname__}) is not allowed; use letters, "
                "digits, '_', '.' and '-' (at most 128), starting with a letter, digit or '_'"
            )
        if name in seen:
            raise UsageError(f"two side inputs are named {name!r}: {seen[name]} and {entry!r}")
        seen[name] = repr(entry)
        Schedule.of(cls)
        if not cls.timeout > 0:
            raise UsageError(f"side input {name!r}: timeout must be > 0 seconds")
        classes.append(cls)
    return classes
