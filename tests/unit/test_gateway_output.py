"""OpenAI's output fields at the gateway: ``size: "auto"``, ``output_format`` and
``output_compression`` checked with the field named, PNGs transcoded to what was asked, and
``usage`` summed from what each image was charged."""

from __future__ import annotations

import asyncio
import io

import pytest
from PIL import Image

from libs.models.flux_workflows import tiny_flux
from libs.protocol.messages import RequestResult
from libs.sim.workflows import sim_workflow
from services.gateway.errors import ApiError
from services.gateway.formats import encode_as, suffix_format, transcode
from services.gateway.generation import parse_generation
from services.gateway.results import usage_of


def png(width: int = 32, height: int = 24, mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, (width, height), (200, 30, 90) if mode == "RGB" else (200, 30, 90, 128)).save(buf, "PNG")
    return buf.getvalue()


def parse(body: dict, spec=None):
    return parse_generation({"model": "m", "prompt": "a fox", **body}, spec or tiny_flux(), max_n=4)


def refused(body: dict, spec=None) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse(body, spec)
    return e.value


def test_size_auto_is_the_workflows_default_size():
    spec = tiny_flux()
    auto = parse({"size": "auto"}, spec)
    assert auto.size == spec.sizes[0]
    assert (auto.params[0]["width"], auto.params[0]["height"]) == tuple(map(int, spec.sizes[0].split("x")))
    assert parse({"size": "auto"}, sim_workflow("fixed", "fast")).size is None  # a fixed size: fine
    assert refused({"size": "huge"}, spec).param == "size"


def test_output_format_and_compression_are_checked():
    assert (parse({}).output_format, parse({}).output_compression) == ("png", 100)
    got = parse({"output_format": "webp", "output_compression": 40})
    assert (got.output_format, got.output_compression) == ("webp", 40)
    assert refused({"output_format": "gif"}).param == "output_format"
    assert refused({"output_format": ["png"]}).param == "output_format"
    for bad in (-1, 101, 50.5, "80", True):
        assert refused({"output_format": "jpeg", "output_compression": bad}).param == "output_compression"
    assert parse({"background": "opaque"}).output_format == "png"
    assert refused({"background": "transparent"}).param == "background"
    e = refused({"output_compression": 80})  # PNG is lossless
    assert e.param == "output_compression" and "jpeg" in e.message and e.status == 422


@pytest.mark.parametrize(("fmt", "pil"), [("jpeg", "JPEG"), ("webp", "WEBP"), ("png", "PNG")])
def test_pngs_are_transcoded_to_the_format_asked(fmt, pil):
    out = asyncio.run(transcode(png(), fmt, 80, asyncio.Semaphore(1)))
    with Image.open(io.BytesIO(out)) as img:
        assert img.format == pil and img.size == (32, 24)


def test_compression_trades_size_for_quality_and_alpha_survives_webp_only():
    noisy = io.BytesIO()
    Image.effect_noise((128, 128), 64).convert("RGB").save(noisy, "PNG")
    assert len(encode_as(noisy.getvalue(), "jpeg", 10)) < len(encode_as(noisy.getvalue(), "jpeg", 95))
    rgba = png(mode="RGBA")
    with Image.open(io.BytesIO(encode_as(rgba, "webp", 90))) as img:
        assert "A" in img.getbands()
    with Image.open(io.BytesIO(encode_as(rgba, "jpeg", 90))) as img:
        assert img.mode == "RGB"


def test_file_suffixes_name_formats():
    assert [suffix_format(n) for n in ("image.png", "image.jpg", "image.JPEG", "image.webp")] == [
        "png",
        "jpeg",
        "jpeg",
        "webp",
    ]
    assert [suffix_format(n) for n in ("image.gif", "image", ".png")] == [None, None, None]


def test_usage_sums_the_gpu_seconds_each_image_was_charged():
    done = [
        RequestResult(request_id=f"g-{i}", status="succeeded", gpu_s=s) for i, s in enumerate((1.25, 0.5))
    ]
    usage = usage_of([*done, None])  # the third has not ended
    assert usage["gpu_seconds"] == 1.75 and usage["gpu_seconds_per_image"] == [1.25, 0.5, 0.0]
    assert usage["input_tokens"] == usage["output_tokens"] == usage["total_tokens"] == 0
    assert usage["input_tokens_details"] == {"text_tokens": 0, "image_tokens": 0}
