"""A node's probes: ``GET /healthz`` (the process is alive and answering) and ``GET /ready``
(it can serve: 503 until its store check, cluster identity, engine, side inputs and membership
are ready, and again from the moment it drains).

A node listens from the start of :meth:`Node.start`, so that a probe is answered while Spark
starts; until the node runs, every other endpoint answers 503 ``{"starting": true}``, which
peers take as a node that is not serving (as they take a refused connection).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import web
from aiohttp.typedefs import Middleware

__all__ = ["CHECKS", "STARTING_HEADER", "Readiness", "starting_gate"]

#: What a node must have before it is ready, in the order it gets them.
CHECKS: Final = ("store", "identity", "engine", "side_inputs", "membership")
#: The header of a 503 that says "this node is starting" (peers read it, not the body).
STARTING_HEADER: Final = "X-Deltaflow-Starting"
#: Answered whatever the node's state.
ALWAYS: Final = frozenset({"/healthz", "/ready", "/metrics", "/", "/status.js", "/v1/status"})


class Readiness:
    """Which of :data:`CHECKS` a node has passed, and whether it serves (not draining)."""

    def __init__(self, node_id: str, state: Callable[[], str], serving: Callable[[], bool]) -> None:
        self.node_id = node_id
        self.passed: dict[str, bool] = dict.fromkeys(CHECKS, False)
        self._state = state
        self.serving = serving  # admitted to the cluster, not leaving it

    @property
    def state(self) -> str:
        return self._state()

    def mark(self, check: str) -> None:
        self.passed[check] = True

    @property
    def starting(self) -> bool:
        return self.state in ("created", "starting")

    @property
    def ready(self) -> bool:
        return self.state == "running" and all(self.passed.values()) and self.serving()

    async def healthz(self, request: web.Request) -> web.Response:
        """Alive: the process answers (whatever it can serve)."""
        return web.json_response({"node": self.node_id, "state": self.state})

    def document(self) -> dict[str, object]:
        """``{"node", "state", "ready", "checks"}``: what ``/ready`` answers."""
        checks = dict(self.passed)
        checks["serving"] = self.state == "running" and self.serving()
        return {"node": self.node_id, "state": self.state, "ready": self.ready, "checks": checks}

    async def ready_handler(self, request: web.Request) -> web.Response:
        """200 once the node can serve; 503 with what it still waits for, or why not."""
        return web.json_response(self.document(), status=200 if self.ready else 503)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def starting_gate(readiness: Readiness) -> Middleware:
    """An aiohttp middleware: while the node starts, only the probes and metrics answer."""

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        if readiness.starting and request.path not in ALWAYS:
            return web.json_response(
                {"error": f"node {readiness.node_id} is starting", "starting": True},
                status=503,
                headers={STARTING_HEADER: "1"},
            )
        return await handler(request)

    return gate
