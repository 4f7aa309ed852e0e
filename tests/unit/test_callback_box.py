"""The executor's mailbox for callback inputs whose producer was still running (§5.2)."""

from __future__ import annotations

import threading

import pytest

from services.executor.callbacks import CallbackBox
from services.executor.outcome import NodeError


def test_metadata_delivered_before_or_after_the_wait_reaches_the_waiting_node():
    box = CallbackBox()
    box.deliver(box.key("r/1/n", "c"), "early")
    assert box.wait(box.key("r/1/n", "c"), 1.0) == "early"
    got = []
    waiting = threading.Thread(target=lambda: got.append(box.wait(box.key("r/1/m", "c"), 10.0)))
    waiting.start()
    while not box._waiting:  # noqa: SLF001 - wait until the thread is parked, then deliver
        threading.Event().wait(0.001)
    box.deliver(box.key("r/1/m", "c"), "late")
    waiting.join(10)
    assert got == ["late"] and len(box) == 0


def test_releasing_the_request_cancels_its_waits_and_drops_undelivered_values():
    box = CallbackBox()
    errors = []

    def wait():
        try:
            box.wait(box.key("r/2/n", "c"), 10.0)
        except NodeError as e:
            errors.append(e)

    t = threading.Thread(target=wait)
    t.start()
    while not box._waiting:  # noqa: SLF001
        threading.Event().wait(0.001)
    box.deliver(box.key("r/3/x", "c"), "other attempt")
    box.cancel("r", 2)
    t.join(10)
    assert len(errors) == 1 and "cancelled" in str(errors[0]) and not errors[0].retryable
    box.cancel("r", 3)
    assert len(box) == 0  # nothing accumulates for requests that ended


def test_a_callback_that_never_comes_times_out_retryably():
    box = CallbackBox()
    with pytest.raises(NodeError) as e:
        box.wait(box.key("r/1/n", "c"), 0.05)
    assert e.value.retryable and "did not arrive" in str(e.value)
