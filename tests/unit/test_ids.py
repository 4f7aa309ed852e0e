"""The identifier formats of libs/protocol/ids.py: each value round-trips through its one encoder
and decoder, and a malformed string off the bus is refused with a message naming it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.protocol.ids import AttemptRef, CallbackRef, ModelKey, NodeRef, TensorRef, image_object

request_ids = st.text(alphabet="0123456789abcdef", min_size=1, max_size=20)
attempts = st.integers(min_value=0, max_value=10_000)
names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,15}(@[0-9]{1,3})?", fullmatch=True)


@settings(max_examples=50)
@given(request_ids, attempts, names, names)
def test_every_reference_round_trips_through_its_string_form(rid: str, attempt: int, node: str, out: str):
    ref = NodeRef(rid, attempt, node)
    assert NodeRef.decode(ref.encode()) == ref
    assert AttemptRef.decode(ref.attempt_ref.encode()) == ref.attempt_ref
    assert TensorRef.decode(ref.output(out).encode()) == ref.output(out)
    assert CallbackRef.decode(ref.callback(out).encode()) == ref.callback(out)
    assert TensorRef.decode(ref.output(out).at(attempt).encode()) == ref.output(out).at(attempt)


def test_the_string_forms_are_the_documented_ones():
    node = NodeRef("r1", 2, "transformer@3")
    assert node.encode() == "r1/2/transformer@3"
    assert node.attempt_ref.encode() == "r1/2"
    assert node.output("latents").encode() == "r1/2/transformer@3/latents"
    assert node.output("block_samples").at(4).encode() == "r1/2/transformer@3/block_samples#4"
    assert node.callback("controlnet_block_samples").encode() == "r1/2/transformer@3:controlnet_block_samples"
    assert ModelKey("flux.transformer", "tiny-flux").encode() == "flux.transformer|tiny-flux"
    assert image_object("r1", "image") == "r1/image.png"


def test_a_node_of_an_attempt_belongs_to_that_attempt_and_no_other():
    attempt = AttemptRef("r1", 1)
    assert attempt.node("a").attempt_ref == attempt
    assert attempt.node("a").attempt_ref != AttemptRef("r1", 2)
    assert attempt.node("a").attempt_ref != AttemptRef("r10", 1)  # no string-prefix confusion


@settings(max_examples=50)
@given(st.text(min_size=1, max_size=20).filter(lambda s: "|" not in s), st.text(min_size=1, max_size=20))
def test_model_keys_round_trip_even_with_odd_model_names(fn: str, model: str):
    key = ModelKey(fn, model)
    assert ModelKey.decode(key.encode()) == key


@pytest.mark.parametrize(
    ("decode", "raw"),
    [
        (NodeRef.decode, "r1/x/node"),
        (NodeRef.decode, "r1/1"),
        (NodeRef.decode, "/1/node"),
        (NodeRef.decode, "r1/1/"),
        (AttemptRef.decode, "r1"),
        (AttemptRef.decode, "r1/-1"),
        (TensorRef.decode, "r1/1/node"),
        (TensorRef.decode, "r1/1/node/"),
        (TensorRef.decode, "r1/1/node/out#x"),
        (CallbackRef.decode, "r1/1/node"),
        (ModelKey.decode, "no-separator"),
        (ModelKey.decode, "|model"),
        (ModelKey.decode, "fn|"),
    ],
)
def test_a_malformed_identifier_is_refused_with_its_text_in_the_message(decode, raw: str):
    with pytest.raises(ValueError) as caught:
        decode(raw)
    assert repr(raw) in str(caught.value)


def test_an_image_object_refuses_a_request_id_that_would_change_its_folder():
    with pytest.raises(ValueError, match="request id"):
        image_object("../other", "image")


def test_image_request_ids_and_loop_suffixes_are_built_and_parsed_in_one_place():
    from libs.protocol.ids import generation_of, image_request_id, loop_suffix, split_node_id

    rid = image_request_id("3f2a-call", 4)
    assert rid == "3f2a-call-4" and generation_of(rid) == "3f2a-call"
    assert generation_of("lonely") == "lonely"
    node = "transformer" + loop_suffix(loop_suffix("", 3), 1)
    assert node == "transformer@3.1" and split_node_id(node) == ("transformer", ("3", "1"))
    assert split_node_id("vae") == ("vae", ())
