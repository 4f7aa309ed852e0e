"""Credentials without a broker: settings fold them into the URLs, and each role's permissions."""

from __future__ import annotations

import pytest

from libs.common.config import ConfigError
from libs.common.nats_conn import inbox_prefix, split_credentials
from libs.common.settings import common_settings, redact
from libs.launcher.creds import ADMIN, ROLES, Credentials, nats_permissions, redis_rules


def test_user_and_password_settings_end_up_in_the_urls_and_nowhere_in_the_repr(tmp_path):
    pw = tmp_path / "pw"
    pw.write_text("s3cr@t/:x\n")
    s = common_settings(
        {
            "T2I_NATS_URL": "nats://nats:4222",
            "T2I_NATS_USER": "t2i-gateway",
            "T2I_NATS_PASSWORD_FILE": str(pw),
            "T2I_REDIS_USER": "t2i-gateway",
            "T2I_REDIS_PASSWORD": "r-pw",
        }
    )
    assert s.nats_url == "nats://t2i-gateway:s3cr%40t%2F%3Ax@nats:4222"
    assert split_credentials(s.nats_url) == ("nats://nats:4222", "t2i-gateway", "s3cr@t/:x")
    assert s.redis_url == "redis://t2i-gateway:r-pw@127.0.0.1:6379/0"
    assert "s3cr" not in repr(s) and "r-pw" not in repr(s)
    assert redact(s.redis_url) == "redis://t2i-gateway:***@127.0.0.1:6379/0"
    assert common_settings({}).nats_url == "nats://127.0.0.1:4222"  # no credentials: as before


def test_a_password_twice_or_an_unreadable_password_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="T2I_NATS_PASSWORD or T2I_NATS_PASSWORD_FILE"):
        common_settings({"T2I_NATS_PASSWORD": "a", "T2I_NATS_PASSWORD_FILE": str(tmp_path / "x")})
    with pytest.raises(ConfigError, match="T2I_REDIS_PASSWORD_FILE"):
        common_settings({"T2I_REDIS_PASSWORD_FILE": str(tmp_path / "missing")})


def test_each_user_subscribes_to_its_own_inbox_only():
    assert inbox_prefix("") == "_INBOX"
    assert inbox_prefix("t2i-gateway") == "_INBOX.t2i-gateway"
    for role in ("gateway", "scheduler", "executor"):
        subs = nats_permissions("t2i", role, f"t2i-{role}")["subscribe"]["allow"]
        assert f"_INBOX.t2i-{role}.>" in subs and "_INBOX.>" not in subs


def test_only_the_admin_may_do_everything_and_no_role_may_create_streams_or_foreign_consumers():
    for role in ROLES:
        p = nats_permissions("t2i", role, f"t2i-{role}")
        allowed = p["publish"].get("allow", []) + p["subscribe"].get("allow", [])
        assert ">" not in allowed and not any(a.startswith("$JS.API.STREAM.CREATE") for a in allowed)
        consumers = [a for a in allowed if "CONSUMER" in a]
        assert all(".T2I_INTAKE.scheduler" in a for a in consumers), (role, consumers)
        assert role == "scheduler" or not consumers
    assert nats_permissions("t2i", ADMIN, "t2i-admin")["publish"]["allow"] == [">"]
    registry = nats_permissions("t2i", "registry", "t2i-registry")
    assert registry["publish"] == {"deny": [">"]} and registry["allow_responses"] is True
    executor = nats_permissions("t2i", "executor", "x", executor_ids=["t2i-executor-0"])
    assert executor["subscribe"]["allow"][:3] == [
        "t2i.exec.t2i-executor-0",
        "t2i.exec.t2i-executor-0.release",
        "t2i.exec.all",
    ]
    assert "t2i.results.*" not in executor["publish"]["allow"]


def test_executors_publish_their_own_events_and_peers_releases_only():
    """Not another executor's Dispatch (``exec.<id>`` is the scheduler's), not its events."""
    own = nats_permissions("t2i", "executor", "x", executor_ids=["t2i-e0", "t2i-e1"])["publish"]
    assert own["allow"][:3] == ["t2i.sched.events.t2i-e0", "t2i.sched.events.t2i-e1", "t2i.exec.*.release"]
    assert not any(a in own["allow"] for a in ("t2i.exec.*", "t2i.exec.>", "t2i.sched.events.*"))
    # The generic user (compose replicas share it) reports for any id: the scheduler still checks
    # each event against its subject.
    generic = nats_permissions("t2i", "executor", "t2i-executor")["publish"]["allow"]
    assert generic[:2] == ["t2i.sched.events.*", "t2i.exec.*.release"] and "t2i.exec.*" not in generic
    assert "t2i.registry.advertise" in generic  # its ModelFns, to the registry (and no other op)
    assert not any(a.startswith("t2i.registry.") and a != "t2i.registry.advertise" for a in generic)
    scheduler = nats_permissions("t2i", "scheduler", "t2i-scheduler")
    assert scheduler["subscribe"]["allow"][0] == "t2i.sched.events.*"
    assert "t2i.exec.*" in scheduler["publish"]["allow"]  # Dispatch, CancelNode, ...


def test_executors_reach_only_gpu_leases_and_every_redis_user_stays_in_its_namespace():
    executor = redis_rules("t2i", "executor")
    assert executor is not None and [r for r in executor if "~" in r and not r.startswith("(")] == [
        "~t2i:gpu:*"
    ]
    assert "+hset" not in executor and "+set" in executor
    # Hash commands only on the NVSHMEM worlds' keys (their join gate), inside the leases' prefix.
    assert [r for r in executor if r.startswith("(")] == [
        "(~t2i:gpu:*:nvshmem:* +hget +hset +hincrby +pexpire)"
    ]
    creds = Credentials.generate("t2i", {"executor-0": ["t2i-executor-0"]})
    assert set(creds.redis) == {"gateway", "registry", "scheduler", "executor"}
    assert creds.nats_user("executor-0").executor_ids == ("t2i-executor-0",)
    assert creds.nats_user("executor-7") is creds.nats["executor"]  # unknown: the generic user
    for role in creds.redis:
        rules = redis_rules("t2i", role)
        assert rules is not None and "-@all" in rules
        keys = [r for r in rules if "~" in r and not r.startswith("(")]
        assert keys and all(r.split("~", 1)[1].startswith("t2i:") for r in keys), keys
    assert "+hset" in redis_rules("t2i", "gateway")  # request state
    assert "%R~t2i:vtime" in redis_rules("t2i", "gateway")  # the counters: read only
    passwords = {u.password for u in (*creds.nats.values(), *creds.redis.values())}
    assert len(passwords) == len(creds.nats) + len(creds.redis)
    assert Credentials.generate("t2i").nats["gateway"].password != creds.nats["gateway"].password
