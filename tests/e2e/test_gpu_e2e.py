"""End to end on a GPU (marked ``gpu``; skipped, with the reason, elsewhere): gateway, registry,
scheduler and two CUDA executors as separate processes, tensors moving between the executors' device
arenas over CUDA IPC; the PNG that comes back equals diffusers' FluxPipeline run on the same GPU at
the same dtype (fp32), with the same deterministic cuBLAS workspace setting in both."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.e2e.test_generate_e2e import generate, pixels, request_state, start_stack, stop_stack

pytestmark = [pytest.mark.e2e, pytest.mark.gpu]

DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def test_a_tiny_flux_request_on_cuda_equals_the_pipeline_on_the_same_gpu(broker_urls, tiny_models, tmp_path):
    import torch
    from diffusers import FluxPipeline

    os.environ.update(DETERMINISTIC)
    stack = start_stack(
        broker_urls, tiny_models, tmp_path / "logs",
        extra_env={"T2I_EXECUTOR_DEVICE": "cuda", "T2I_EXECUTOR_DTYPES": "*=float32", **DETERMINISTIC},
    )  # fmt: skip
    try:
        status, body = generate(
            stack, prompt="a lighthouse at dusk", seed=7, num_inference_steps=4, size="128x64"
        )
        assert status == 200, (body, stack.tail("executor-0"), stack.tail("executor-1"))
        got = pixels(body["data"][0]["b64_json"])
        state = request_state(stack, f"{body['id']}-0")
        logs = stack.read_log("executor-0") + stack.read_log("executor-1")
        assert "cuda_ipc arena" in logs  # the device arena's transport (the ready line)
    finally:
        stop_stack(stack, broker_urls)
    pipe = FluxPipeline.from_pretrained(tiny_models / "tiny-flux").to("cuda")
    with torch.no_grad():
        want = pipe(
            "a lighthouse at dusk", height=64, width=128, num_inference_steps=4, guidance_scale=3.5,
            generator=torch.Generator().manual_seed(7), max_sequence_length=64,
        ).images[0]  # fmt: skip
    assert np.array_equal(got, np.array(want))
    assert int(state["bytes_moved"]) > 0  # some node pulled an input from the other executor's arena
