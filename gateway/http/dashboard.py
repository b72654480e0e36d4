"""The mesh dashboard: a page at ``/`` and the live JSON it polls.

Contract: ``dashboard_router(mesh, metrics, outstanding, api_keys)`` returns
a FastAPI router with
- ``GET /``: the page (``gateway/static/dashboard.html``), always open: it
  holds no data, and asks for the API key when the live data answers 401;
- ``GET /dashboard/{dashboard.js,dashboard.css}``: its assets, shipped inside
  the package (no CDN, no network, no build step: Macs on a Thunderbolt
  bridge are often offline);
- ``GET /dashboard/live``: the live document (``gateway.http.live``), built from
  the coordinator's snapshot and the gateway's own metrics. With API keys
  set it requires ``Authorization: Bearer <key>`` like ``/v1`` (401 in
  OpenAI's envelope otherwise).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import resources
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response

from stagemesh_core.snapshots import MeshView

from . import errors
from .auth import ApiKeyMiddleware
from .live import LiveSampler
from .metrics import GatewayMetrics

LIVE_PATH = "/dashboard/live"
_ASSETS = {"dashboard.js": "text/javascript; charset=utf-8", "dashboard.css": "text/css; charset=utf-8"}


def _asset(name: str) -> str:
    return resources.files("gateway").joinpath("static", name).read_text(encoding="utf-8")


def dashboard_router(mesh: MeshView, metrics: GatewayMetrics, outstanding: Callable[[], Mapping[int, int]],
                     api_keys: tuple[str, ...]) -> APIRouter:
    router = APIRouter()
    sampler = LiveSampler(metrics)
    keys = ApiKeyMiddleware(None, api_keys)  # only its check is used: the same rule as /v1
    # Read once: the files ship with the package and do not change while it runs.
    page = _asset("dashboard.html")
    assets = {name: _asset(name) for name in _ASSETS}
    no_store = {"cache-control": "no-store"}

    @router.get("/", include_in_schema=False)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers=no_store)

    @router.get(LIVE_PATH)
    async def live(request: Request) -> JSONResponse:
        if not keys.allows(dict(request.scope)):
            raise errors.unauthorized()
        document: dict[str, Any] = sampler.document(mesh.snapshot(), outstanding(), auth_required=bool(api_keys))
        return JSONResponse(document, headers=no_store)

    # After the live route: this one would match its path too.
    @router.get("/dashboard/{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        if name not in assets:
            raise errors.APIError(404, f"No dashboard asset {name!r}; there are {', '.join(sorted(assets))}",
                                  param="name", code="not_found")
        return Response(assets[name], media_type=_ASSETS[name], headers=no_store)

    return router
