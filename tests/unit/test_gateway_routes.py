"""The gateway's route modules (``services/gateway/routes/``, one per resource): each adds its own
routes, the app is exactly their union, and none imports another (what several need is in the
package's ``__init__``)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

from aiohttp import web

from libs.common.settings import CommonSettings
from services.gateway import openapi
from services.gateway.app import make_app
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig

ROUTES = Path(__file__).resolve().parents[2] / "services/gateway/routes"
PACKAGE = "services.gateway.routes"
MODULES = sorted(p.stem for p in ROUTES.glob("*.py") if p.stem != "__init__")


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, ``from package import name`` counted as ``package.name``."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def test_no_route_module_imports_another():
    others = {f"{PACKAGE}.{m}" for m in MODULES}
    for name in MODULES:
        assert not imported(ROUTES / f"{name}.py") & others, f"routes/{name}.py imports another route module"


def test_the_app_serves_exactly_the_routes_its_modules_add():
    union: list[tuple[str, str]] = []
    for name in MODULES:
        bare = web.Application()
        importlib.import_module(f"{PACKAGE}.{name}").add_routes(bare.router)
        added = openapi.route_paths(bare)
        assert added, f"routes/{name}.py adds no route"
        union += added
    assert len(union) == len(set(union)), "a route is added by two modules"
    app = make_app(GatewayConfig(), CommonSettings(), ApiKeys({}))
    assert sorted(openapi.route_paths(app)) == sorted(union)
