"""The launcher starts NATS (JetStream) and Redis where none answers, and leaves running ones alone."""

from __future__ import annotations

import asyncio
import shutil

import nats
import pytest

from libs.launcher import brokers
from tests.conftest import free_port


def test_nats_and_redis_are_started_on_free_ports_and_stopped_again(tmp_path):
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed here")
    nport, rport = free_port(), free_port()
    procs = brokers.ensure_brokers(
        f"nats://127.0.0.1:{nport}", f"redis://127.0.0.1:{rport}/0", tmp_path, log=lambda *_: None
    )
    try:
        assert len(procs) == 2
        assert brokers.redis_answers("127.0.0.1", rport)

        async def jetstream_works() -> int:
            nc = await nats.connect(f"nats://127.0.0.1:{nport}")
            try:
                js = nc.jetstream()
                await js.add_stream(name="PROBE", subjects=["probe"])
                ack = await js.publish("probe", b"x")
                return ack.seq
            finally:
                await nc.close()

        assert asyncio.run(jetstream_works()) == 1
    finally:
        brokers.stop(procs)
    assert not brokers.answers("127.0.0.1", nport) and not brokers.redis_answers("127.0.0.1", rport)


def test_servers_that_already_answer_are_used_not_started(broker_urls, tmp_path):
    nats_url, redis_url = broker_urls
    assert brokers.ensure_brokers(nats_url, redis_url, tmp_path, log=lambda *_: None) == []


def test_a_remote_broker_that_does_not_answer_is_a_clear_error(tmp_path):
    with pytest.raises(brokers.BrokerError, match="does not answer"):
        brokers.ensure_brokers(
            "nats://192.0.2.1:4222", "redis://127.0.0.1:6379/0", tmp_path, log=lambda *_: None
        )
