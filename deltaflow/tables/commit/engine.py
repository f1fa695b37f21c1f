"""What the commit wing needs of the node's table engine (:class:`.TableEngine` is both).

A table's committer only reads the table's settings, commits actions others wrote and writes
checkpoints: :class:`CommitterEngine`. A partition owner also creates tables, writes data
files and applies groups itself: :class:`OwnerEngine`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ...storage.paths import Location
    from ..atomicity import CommitAtomicity
    from ..engine_settings import EngineSettings
    from ..group import GroupWrite
    from ..log_reader import LogReader
    from ..mark_store import MarkStores
    from ..settings import TableSettings
    from ..statistics import EngineStatistics
    from .prepared import CommitSink

__all__ = ["CommitterEngine", "OwnerEngine"]


class CommitterEngine(Protocol):
    """What a table's committer (:class:`.TableCommitter`) uses."""

    warehouse: Location
    node_id: str
    settings: EngineSettings
    stats: EngineStatistics
    atomicity: CommitAtomicity
    mark_stores: MarkStores

    def in_thread(self, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]: ...
    def describe(self, table: str, path: Location) -> Any: ...
    def checkpoint(self, table: str, path: Location, version: int) -> None: ...
    def commit_actions(
        self, table: str, path: Location, version: int, actions: list[dict[str, Any]], metadata: str
    ) -> int: ...


class OwnerEngine(CommitterEngine, Protocol):
    """What a partition owner's side of a table (:class:`.TableOwner`) uses besides."""

    log: LogReader
    checkpoints_due: dict[Location, int]
    commit_sink: CommitSink | None
    prepares_groups: bool

    def create(self, table: str, path: Location, schema: Any, settings: TableSettings) -> None: ...
    def add_columns(self, table: str, path: Location, fields: Sequence[Any]) -> None: ...
    def merges_on_read(self, settings: TableSettings) -> bool: ...
    def write(self, group: GroupWrite) -> None: ...
    def write_group_files(self, group: GroupWrite, target: Any) -> Any: ...
    def landed(self, path: Location, done: Any) -> None: ...
