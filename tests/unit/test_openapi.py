"""``GET /openapi.json``: a valid OpenAPI 3.1 document that lists every route the gateway serves,
each with a description, and whose bodies match what the handlers accept."""

from __future__ import annotations

import msgspec
import pytest
from openapi_spec_validator import validate

from libs.common.settings import CommonSettings
from services.gateway import generation, openapi, schemas
from services.gateway.app import PUBLIC, make_app
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig


@pytest.fixture(scope="module")
def app():
    return make_app(GatewayConfig(), CommonSettings(), ApiKeys({}))


@pytest.fixture(scope="module")
def doc(app):
    return openapi.build(app)


def test_the_document_is_valid_openapi_3_1(doc):
    validate(doc)
    assert doc["openapi"].startswith("3.1")


def test_every_registered_route_is_described(app, doc):
    """Walks the router itself: a route added to make_app without an OPERATIONS entry fails here."""
    seen = 0
    for route in app.router.routes():
        if route.method == "HEAD":
            continue
        seen += 1
        method, path = _route_key(route)
        assert (method, path) in openapi.OPERATIONS, f"{method} {path} has no description in openapi.py"
        operation = doc["paths"][path][method.lower()]
        assert operation["summary"] and operation["summary"] != "Undocumented route"
        assert operation["responses"]
    assert seen >= 15
    assert openapi.undocumented(app) == []


def _route_key(route) -> tuple[str, str]:
    info = route.resource.get_info()
    if "prefix" in info:
        return route.method, info["prefix"].rstrip("/") + "/{filename}"
    if "formatter" in info:
        return route.method, openapi.PATH_PARAM.sub(lambda m: "{" + m.group(1) + "}", info["formatter"])
    return route.method, info["path"]


def test_public_routes_need_no_key_in_the_document_too(doc):
    for path in PUBLIC:
        assert doc["paths"][path]["get"]["security"] == []
    assert "security" not in doc["paths"]["/v1/models"]["get"]  # the document's default: a key


def test_path_parameters_are_declared(doc):
    params = doc["paths"]["/v1/requests/{id}"]["get"]["parameters"]
    assert {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}} in params


def test_the_generation_body_documents_every_field_the_gateway_accepts(doc):
    fields = {f.name for f in msgspec.structs.fields(schemas.ImageGenerationRequest)}
    assert generation.KNOWN <= fields
    props = doc["components"]["schemas"]["ImageGenerationRequest"]["properties"]
    assert sorted(props["output_format"]["enum"]) == ["jpeg", "png", "webp"]
    assert set(doc["components"]["schemas"]["ImageGenerationRequest"]["required"]) == {"model", "prompt"}


def test_answers_carry_usage_in_the_schema(doc):
    comps = doc["components"]["schemas"]
    assert "usage" in comps["ImagesResponse"]["required"]
    assert "usage" in comps["RequestStatus"]["required"]
    assert {"gpu_seconds", "gpu_seconds_per_image", "input_tokens"} <= set(comps["Usage"]["properties"])
