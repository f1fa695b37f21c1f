"""A node's status page: ``GET /`` serves a page (no data in it, so no token), ``GET
/status.js`` its script, and ``GET /v1/status`` the node's state as JSON, behind the token
``/metrics`` asks for. The page asks for the token once (kept in the tab's session storage)
and refreshes every two seconds: the cluster as this node sees it, each table this node
writes (recent commits, rows per second, time to table, a chart of its latest commits) and
the latest errors it sent.

Table names and error messages come from clients: the script puts them in the page as text,
never as markup, and the page's Content-Security-Policy allows no other script.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any, Final, Protocol

from aiohttp import web

from ..partitioning import PartitionMap
from .probes import Readiness
from .statistics import NodeStatistics

__all__ = ["PAGE_HEADERS", "StatusSource", "handler", "page", "script", "status_document"]

#: No inline script, no other origin: a table name that holds markup stays text.
PAGE_HEADERS: Final = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; "
        "connect-src 'self'; img-src 'self' data:; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
#: Seconds of commits the rows-per-second figure is taken over.
RATE_WINDOW: Final = 60.0


def _asset(name: str) -> str:
    return resources.files(__package__).joinpath("status_page", name).read_text("utf-8")


# Read when the module is imported, never on the event loop.
_PAGE: Final = _asset("index.html")
_SCRIPT: Final = _asset("status.js")


async def page(request: web.Request) -> web.Response:
    return web.Response(text=_PAGE, content_type="text/html", headers=PAGE_HEADERS)


async def script(request: web.Request) -> web.Response:
    return web.Response(text=_SCRIPT, content_type="application/javascript", headers=PAGE_HEADERS)


class StatusSource(Protocol):
    """What the status page reads of a node (``Node`` is one)."""

    address: str
    readiness: Readiness
    created_at: float

    @property
    def partition_map(self) -> PartitionMap: ...

    def statistics(self) -> NodeStatistics: ...

    def members(self) -> list[dict[str, Any]]: ...

    def check_token(self, given: str | None) -> bool: ...


def handler(node: StatusSource) -> Callable[[web.Request], Awaitable[web.Response]]:
    """``GET /v1/status`` of ``node``, behind the token ``/metrics`` asks for."""

    async def status(request: web.Request) -> web.Response:
        header = request.headers.get("Authorization", "")
        if not node.check_token(header[7:] if header.startswith("Bearer ") else None):
            return web.json_response({"error": "wrong or missing token"}, status=401)
        pmap = node.partition_map
        document = status_document(
            node.statistics(),
            address=node.address,
            ready=node.readiness.document(),
            members=node.members(),
            owners=pmap.owners,
            committer=pmap.committer,
            started_at=node.created_at,
        )
        return web.json_response(document)

    return status


def status_document(
    stats: NodeStatistics,
    *,
    address: str,
    ready: dict[str, Any],
    members: list[dict[str, Any]],
    owners: tuple[str, ...],
    committer: Any,
    started_at: float,
) -> dict[str, Any]:
    """What ``/v1/status`` answers (``committer(table)``: the table's committer, or None)."""
    now = time.time()
    partitions: dict[str, int] = {}
    for owner in owners:
        partitions[owner] = partitions.get(owner, 0) + 1
    for member in members:
        member["partitions"] = partitions.get(str(member["node"]), 0)
    tables: dict[str, Any] = {}
    for name, t in sorted(stats.engine.tables.items()):
        if t.last_version is None and not (t.commits or t.queued_rows or t.in_flight_batches):
            continue  # never created (its stream was refused): the errors say why
        recent: list[dict[str, Any]] = [
            {"at": at, "rows": rows, "batches": batches, "seconds": round(secs, 4), "version": v}
            for at, rows, batches, secs, v in t.recent
        ]
        in_window = sum(rows for at, rows, *_ in t.recent if now - at <= RATE_WINDOW)
        tables[name] = {
            "committer": committer(name),
            "version": t.last_version,
            "commits": t.commits,
            "rows": t.rows_committed,
            "batches": t.batches_committed,
            "batches_failed": t.batches_failed,
            "conflicts": t.commit_conflicts,
            "queued_rows": t.queued_rows,
            "in_flight_batches": t.in_flight_batches,
            "last_commit_at": t.last_commit_at or None,
            "rows_per_second": round(in_window / RATE_WINDOW, 1),
            "time_to_table": _quantiles(t.batch_durable_seconds_histogram),
            "commit_seconds": _quantiles(t.commit_seconds_histogram),
            "recent": recent,
        }
    d = stats.dispatcher
    return {
        "node": stats.node_id,
        "address": address,
        "state": stats.state,
        "ready": ready,
        "now": now,
        "uptime_seconds": round(now - started_at, 1),
        "map_version": stats.map_version,
        "members": members,
        "streams": d.streams,
        "connections": stats.connections,
        "tables": tables,
        "receivers": {
            name: {
                "batches_acked": r.batches_acked,
                "batches_failed": r.batches_failed,
                "items_applied": r.items_applied,
                "items_failed": r.items_failed,
                "running": r.running,
            }
            for name, r in sorted(d.receivers.items())
        },
        "errors": dict(sorted(d.errors.items())),
        "recent_errors": [
            {"at": at, "code": code, "message": message}
            for at, code, message in reversed(d.recent_errors)
        ],
    }


def _quantiles(histogram: Any) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        value = histogram.quantile(q)
        out[name] = None if value is None else round(value, 4)
    return out
