"""One tiny point of the end-to-end SLO harness (``bench/slo.py``) per deployment mode: the real
gateway, registry and scheduler over two simulated H800s (profile ``paper-s``, setting S1), a
handful of trace requests replayed through the gateway, judged against their deadlines, with the
load tiers read off the bus and the cached bytes off the heartbeats."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from libs.sim import trace as tracegen

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import slo

pytestmark = pytest.mark.e2e

SCALE = 0.05  # wall seconds per profile second: Z-Image's 17 s take under a second


@pytest.mark.parametrize("mode", slo.MODES)
async def test_a_harness_point_per_mode(broker_urls, tmp_path, mode: str) -> None:
    st = slo.Setting("s1")
    trace = tracegen.generate(st.solo, rate=1.0, duration_s=6.0, slo_scale=1.0, tenants=slo.TENANTS, seed=3)
    assert 3 <= len(trace) <= 12
    keys = ",".join([f"{slo.ADMIN}=ops:admin"] + [f"sk-t{j:02d}=t{j:02d}" for j in range(slo.TENANTS)])
    stack = slo.sim_stack(
        "tslo",
        tmp_path / "logs",
        gpus=2,
        profile=slo.PROFILE,
        time_scale=SCALE,
        api_keys=keys,
        nats_url=broker_urls[0],
        redis_url=broker_urls[1],
        scheduler_env={"T2I_SCHEDULER_POLICY": "fair", "T2I_SCHEDULER_DEPLOYMENT": mode},
    )
    async with slo.running(stack):
        await slo.register(stack, st.specs, slo.ADMIN)
        run = await slo.replay(stack, st, trace, SCALE, 0.0, 1, max_slo=50.0)
    assert not run.dirty
    rec = slo.summarise(run, st, 50.0)
    assert rec["requests"] == len(trace)
    assert rec["succeeded"] == len(trace), rec
    assert rec["attainment"] > 0  # 50x the solo latency: met unless something is badly wrong
    assert 0.0 <= slo.summarise(run, st, 1.0)["attainment"] <= rec["attainment"]
    assert rec["model_loads"] >= len(trace) * 3  # text encoder, DiT, VAE of each request
    assert sum(rec["tiers"].values()) == pytest.approx(1.0)
    assert rec["tiers"]["host"] > 0  # the first requests load from the host tier
    assert rec["tiers"]["disk"] == 0  # simulated executors always read from host memory
    if mode == "nocache":
        assert rec["accelerated"] == 0  # every request loads every model
    assert rec["gpu_mem_gb"] > 0
