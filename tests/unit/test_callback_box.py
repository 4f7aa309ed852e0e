"""The executor's mailbox for callback inputs whose producer was still running (paper §5.2)."""

from __future__ import annotations

import threading

import pytest

from libs.protocol.ids import AttemptRef, NodeRef
from services.executor.callbacks import CallbackBox
from services.executor.outcome import NodeError


def _parked(box: CallbackBox) -> None:
    while not box._waiting:
        threading.Event().wait(0.001)


def test_metadata_delivered_before_or_after_the_wait_reaches_the_waiting_node():
    box = CallbackBox()
    box.deliver(NodeRef("r", 1, "n").callback("c"), "early")
    assert box.wait(NodeRef("r", 1, "n").callback("c"), 1.0) == "early"
    got = []
    waiting = threading.Thread(target=lambda: got.append(box.wait(NodeRef("r", 1, "m").callback("c"), 10.0)))
    waiting.start()
    _parked(box)
    box.deliver(NodeRef("r", 1, "m").callback("c"), "late")
    waiting.join(10)
    assert got == ["late"] and len(box) == 0


def test_releasing_the_request_cancels_its_waits_and_drops_undelivered_values():
    box = CallbackBox()
    errors = []

    def wait():
        try:
            box.wait(NodeRef("r", 2, "n").callback("c"), 10.0)
        except NodeError as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    _parked(box)
    box.deliver(NodeRef("r", 3, "x").callback("c"), "other attempt")
    box.deliver(NodeRef("r2", 2, "x").callback("c"), "other request")
    box.cancel(AttemptRef("r", 2))
    t.join(10)
    assert len(errors) == 1 and "cancelled" in str(errors[0]) and not errors[0].retryable
    assert "r/2/n:c" in str(errors[0])  # named by its encoded CallbackRef
    assert len(box) == 2  # other attempts and other requests keep theirs
    box.cancel(AttemptRef("r", 3))
    box.cancel(AttemptRef("r2", 2))
    assert len(box) == 0  # nothing accumulates for requests that ended


def test_a_request_id_that_prefixes_another_does_not_cancel_it():
    box = CallbackBox()
    box.deliver(NodeRef("r1", 1, "n").callback("c"), "keep")
    box.cancel(AttemptRef("r", 1))
    box.cancel(AttemptRef("r1", 11))
    assert box.wait(NodeRef("r1", 1, "n").callback("c"), 1.0) == "keep"


def test_forget_drops_only_the_deliveries_of_that_node():
    box = CallbackBox()
    box.deliver(NodeRef("r", 1, "n").callback("a"), 1)
    box.deliver(NodeRef("r", 1, "n").callback("b"), 2)
    box.deliver(NodeRef("r", 1, "n2").callback("a"), 3)
    box.forget(NodeRef("r", 1, "n"))
    assert len(box) == 1
    assert box.wait(NodeRef("r", 1, "n2").callback("a"), 1.0) == 3


def test_a_callback_that_never_comes_times_out_retryably():
    box = CallbackBox()
    with pytest.raises(NodeError) as e:
        box.wait(NodeRef("r", 1, "n").callback("c"), 0.05)
    assert e.value.retryable and "did not arrive" in str(e.value)
