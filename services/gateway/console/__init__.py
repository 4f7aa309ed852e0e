"""The web console: a static page the gateway serves at ``GET /console`` (assets under ``/console/``).

The page is public so a browser can load it without a key; everything it shows comes from the API,
called with the key typed into the page, so serving it grants nothing. Only the files named in
:data:`ASSETS` are served (no directory listing, no path from the URL reaches the file system), and
a Content-Security-Policy keeps the page to its own scripts and this gateway: it loads nothing from
the internet (it must work on air-gapped clusters) and an injected string cannot run as a script.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

HERE = Path(__file__).resolve().parent
ASSETS = {
    "index.html": "text/html",
    "app.js": "text/javascript",
    "dag.js": "text/javascript",
    "style.css": "text/css",
}
PREFIX = "/console"
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # small files; a new gateway version shows at once
}


def is_public(path: str) -> bool:
    """The console's paths need no API key (the page asks for one)."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def _file(name: str) -> web.Response:
    kind = ASSETS.get(name)
    if kind is None:
        raise web.HTTPNotFound()
    return web.Response(body=(HERE / name).read_bytes(), content_type=kind, charset="utf-8", headers=HEADERS)


async def page(request: web.Request) -> web.Response:
    """``GET /console``: the single page (playground and operator view)."""
    return _file("index.html")


async def asset(request: web.Request) -> web.Response:
    """``GET /console/{filename}``: the page's scripts and style sheet."""
    return _file(request.match_info["filename"])
