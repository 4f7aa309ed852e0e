"""A gateway call's pieces shared by its routes: what a finished call's ``data`` holds.

``images.py`` (the synchronous answer) and ``jobs.py`` (the status object of async calls, SSE and
webhooks) both build a call's image items here, so neither imports the other for it; how a call's
images combine into one status is ``results.call_status``.
"""

from __future__ import annotations

import base64
from typing import Any

from aiohttp import web

from libs.protocol.messages import RequestResult
from services.gateway.context import BRIDGE, CONFIG, DECODE_SLOTS
from services.gateway.errors import ApiError
from services.gateway.formats import transcode
from services.gateway.records import GenerationRecord


async def result_items(
    request: web.Request, rec: GenerationRecord, results: list[RequestResult], stale: bool
) -> list[dict[str, Any]]:
    """The ``data`` of a call whose images all succeeded: a URL or the image itself (transcoded to
    the call's format) per image, with its seed. ``stale``: a lookup after the answer, where images
    past their hour are a 410 rather than an internal error."""
    cfg, bridge = request.app[CONFIG], request.app[BRIDGE]
    data = []
    for rid, seed, result in zip(rec.request_ids, rec.seeds, results, strict=True):
        ref = next(iter(result.images.values()))
        item: dict[str, Any] = {}
        if rec.response_format == "url":
            base = cfg.public_url.rstrip("/") or f"{request.scheme}://{request.host}"
            name = ref.name.removesuffix(".png") + "." + rec.output_format  # image_file transcodes
            item["url"] = f"{base}/v1/images/files/{name}"
        else:
            png = await bridge.fetch_image(ref, delete=False)  # kept (1 h) for retries and lookups
            if png is None and stale:
                raise ApiError(410, f"the images of {rec.id} have expired (kept 1 h)", code="expired")
            if png is None:
                raise ApiError(500, f"image of {rid} is missing from the object store", code="internal")
            png = await transcode(png, rec.output_format, rec.output_compression, request.app[DECODE_SLOTS])
            item["b64_json"] = base64.b64encode(png).decode()
        if seed is not None:
            item["seed"] = seed
        data.append(item)
    return data
