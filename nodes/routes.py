"""HTTP routes of the pack on the host's server, for the web monitor (``web/``).

``GET /lowvram_lora/progress/{node_id}`` (also under ``/api``): the latest run of that Train LoRA
node in this server process, as one ``lowvram_lora.progress`` event whose ``points`` hold the
whole history; ``{"node": ..., "run": null}`` when the node has not trained since the server
started (not a 404, which a browser logs as a console error). A run that ended without its last
step (an error, an interrupt) reads ``"status": "stopped"``.

:func:`register_routes` is a no-op without a running server (tests that drive the executor
directly), and registers once however often it is called.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from . import progress

log = logging.getLogger(__name__)

ROUTE = "/lowvram_lora/progress/{node_id}"
_registered: set[int] = set()


def _prompt_running(server: Any, prompt_id: str | None) -> bool | None:
    """Whether the host is still executing ``prompt_id``; None when that cannot be told."""
    items = progress.running_prompts(server)
    if prompt_id is None or items is None:
        return None
    return any(len(item) > 1 and str(item[1]) == prompt_id for item in items)


def run_state(server: Any, node_id: str) -> dict[str, Any] | None:
    state = progress.latest_run(node_id)
    if state is not None and state["status"] in ("started", "running"):
        if _prompt_running(server, state["prompt_id"]) is False:
            state["status"] = "stopped"
            state["eta_seconds"] = None
    return state


def register_routes() -> bool:
    """Add the routes to ``PromptServer.instance``; False when there is no server to add them to."""
    host_server = sys.modules.get("server")  # imported by the host's main.py before any pack loads
    prompt_server = getattr(host_server, "PromptServer", None)
    server = getattr(prompt_server, "instance", None)
    if server is None or getattr(server, "routes", None) is None:
        return False
    if id(server) in _registered:
        return True

    from aiohttp import web

    @server.routes.get(ROUTE)
    async def get_progress(request):
        node_id = request.match_info["node_id"]
        state = run_state(server, node_id)
        # not a 404: a browser logs every failed request as a console error
        return web.json_response(state if state is not None else {"node": node_id, "run": None})

    _registered.add(id(server))
    log.debug("registered %s", ROUTE)
    return True
