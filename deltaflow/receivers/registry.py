"""The allow-list of receivers a node runs, by fully qualified class name."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from ..errors import UnknownReceiverError, UsageError
from ..protocol import truncated_repr
from .base import Receiver

__all__ = ["ReceiverRegistry"]


class ReceiverRegistry:
    """Maps class names (``"package.module.Class"``) to receiver classes.

    Names are imported once, when the operator registers them at node start. Looking up a name
    never imports: an unregistered name is an :class:`UnknownReceiverError`.
    """

    def __init__(self) -> None:
        self._classes: dict[str, type[Receiver]] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def names(self) -> list[str]:
        return sorted(self._classes)

    def register(self, cls: type[Receiver], name: str | None = None) -> None:
        if not (isinstance(cls, type) and issubclass(cls, Receiver)):
            raise UsageError(f"{cls!r} is not a subclass of deltaflow.receivers.Receiver")
        bound, retries = cls.max_concurrency, cls.node_retries
        if bound is not None and (not isinstance(bound, int) or bound < 1):
            raise UsageError(
                f"{cls.__qualname__}.max_concurrency must be None or >= 1, not {bound!r}"
            )
        if not isinstance(retries, int) or retries < 0:
            raise UsageError(
                f"{cls.__qualname__}.node_retries must be an int >= 0, not {retries!r}"
            )
        self._classes[name or f"{cls.__module__}.{cls.__qualname__}"] = cls

    def register_names(self, names: Iterable[str]) -> None:
        """Import and register classes named ``"module.Class"`` (operator input, trusted)."""
        for name in names:
            module_name, _, attr = name.rpartition(".")
            if not module_name:
                raise UsageError(f"receiver {name!r} must be a dotted 'module.Class' name")
            try:
                module = importlib.import_module(module_name)
                cls = getattr(module, attr)
            except (ImportError, AttributeError) as exc:
                raise UsageError(f"cannot load receiver {name!r}: {exc}") from exc
            self.register(cls, name)

    def get(self, name: str, *, node: str) -> type[Receiver]:
        try:
            return self._classes[name]
        except KeyError:
            # The name comes from the wire: shown whole only if it is short and printable.
            short = len(name) <= 200 and name.isprintable()
            shown = name if short else truncated_repr(name)
            raise UnknownReceiverError(
                f"receiver {shown!r} is not registered on this node; the operator must start "
                f"it with --receiver {shown} (registered: {', '.join(self.names()) or 'none'})",
                node=node,
            ) from None
