"""The dashboard: a static page (HTML, JS, CSS shipped as package data) at /dashboard.

The page holds no data: its script reads the admin API (`/admin/workers`,
`/admin/decisions`, `/admin/score`) with the admin bearer token the user gives it. So the
files are served without authentication, like any static asset; the data stays guarded.
"""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

# name -> media type; only these files are served.
_FILES = {
    "index.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_HEADERS = {
    "cache-control": "no-cache",
    "x-content-type-options": "nosniff",
    # The page loads only its own files and talks only to this router.
    "content-security-policy": "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'",
    "referrer-policy": "no-referrer",
}


def _load() -> dict[str, bytes]:
    base = resources.files(__name__)
    return {name: base.joinpath(name).read_bytes() for name in _FILES}


def routes() -> list[Route]:
    """GET /dashboard (the page) and GET /dashboard/{file} (its script and style)."""
    files = _load()

    async def page(request: Request) -> Response:
        return Response(files["index.html"], media_type=_FILES["index.html"], headers=_HEADERS)

    async def asset(request: Request) -> Response:
        name = request.path_params["name"]
        if name not in files or name == "index.html":
            return Response("not found\n", status_code=404, media_type="text/plain")
        return Response(files[name], media_type=_FILES[name], headers=_HEADERS)

    return [
        Route("/dashboard", page, methods=["GET"]),
        Route("/dashboard/", page, methods=["GET"]),
        Route("/dashboard/{name}", asset, methods=["GET"]),
    ]
