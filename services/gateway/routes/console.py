"""The web console's page and files (``console/``), public: the page asks for a key."""

from __future__ import annotations

from aiohttp import web

from services.gateway import console


def add_routes(router: web.UrlDispatcher) -> None:
    router.add_get("/console", console.page)
    router.add_get("/console/{filename}", console.asset)
