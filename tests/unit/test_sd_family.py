"""What only the SD1.5 family has: a warm UNet switching between two LoRA files, text-encoder LoRAs
refused, the ControlNet's layout trap, and the builder's zero-initialised weights re-drawn.

What every family shares (each workflow equals StableDiffusionPipeline / StableDiffusionControlNetPipeline
bitwise, warm LoRA switching, mid-forward fetches, signatures, entry points) is
``test_each_family.py``; the harness is :class:`tests.unit.model_families.Sd`.
"""

from __future__ import annotations

import pytest
import torch

from libs.models import sd, sd_controlnet, tiny_sd
from libs.protocol.ids import ModelKey
from libs.workflow.local import LocalRunner
from tests.unit.model_families import SD_LORAS, Sd, harness

# The thread count changes the bits: pipelines and nodes alike run on one thread.
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def h(tmp_path_factory: pytest.TempPathFactory) -> Sd:
    return harness("sd", tmp_path_factory)  # type: ignore[return-value]


@pytest.mark.filterwarnings("ignore:Already found a `peft_config` attribute:UserWarning")  # a 2nd adapter
def test_one_warm_unet_serves_two_lora_files_each_with_the_pipelines_image(h: Sd) -> None:
    warm = LocalRunner(h.root, classes=h.classes())
    name = "tiny-sd15-lora"
    sequence = [
        h.request(name, lora_scale=0.8),
        h.request(name, lora="other", lora_scale=1.0),
        h.request(name, lora=""),
    ]

    images = [h.run(warm, name, params) for params in sequence]

    for params, image in zip(sequence, images, strict=True):
        assert image.same(h.reference(name, params))
    assert len({image.image.tobytes() for image in images}) == len(images)
    switch = warm._components[ModelKey("sd.unet", "tiny-sd15")]["lora"]
    assert len(switch.loaded) == 2, "each adapter file is loaded once and kept"


def test_the_unet_rejects_a_lora_with_text_encoder_layers(h: Sd, tmp_path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "with-text-encoder.safetensors"
    save_file(
        {
            "unet.down_blocks.0.attentions.0.proj_in.lora_A.weight": torch.zeros(4, 16),
            "text_encoder.text_model.encoder.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
        },
        str(path),
    )
    unet = sd.SdUnet()
    components = unet.load_model(str(h.root / "tiny-sd15"), "cpu")
    latents = torch.zeros(1, 4, 8, 8)

    with pytest.raises(ValueError, match="text encoder are not supported"):
        unet.execute(
            components,
            latents=latents,
            timesteps=torch.tensor([1]),
            step=0,
            guidance_scale=1.0,
            prompt_embeds=torch.zeros(1, 77, 32),
            lora=str(path),
        )


def test_the_controlnet_gives_the_same_bits_for_a_channels_last_or_a_contiguous_control_image(h: Sd) -> None:
    # sd.control_image's preprocess returns a channels-last strided tensor; handed over in process (no
    # bytes in between) it reaches sd.controlnet as is. prepare_image's repeat_interleave makes it
    # contiguous, and the convolutions round differently on the two layouts.
    image_node, controlnet = sd_controlnet.SdControlImage(), sd_controlnet.SdControlNet()
    control = image_node.execute(
        image_node.load_model(str(h.root / "tiny-sd15"), "cpu"),
        control_image=h.control_image(),
        height=64,
        width=64,
    )["control_cond"]
    components = controlnet.load_model(str(h.root / "tiny-sd15-controlnet"), "cpu")
    inputs = dict(
        latents=torch.randn(1, 4, 32, 32, generator=torch.Generator().manual_seed(0)),
        timesteps=torch.tensor([901, 601, 301, 1]),
        step=1,
        prompt_embeds=torch.randn(2, 77, 32, generator=torch.Generator().manual_seed(1)),
        control_scale=1.0,
    )

    strided = controlnet.execute(components, control_cond=control, **inputs)
    dense = controlnet.execute(components, control_cond=control.contiguous(), **inputs)

    assert not control.is_contiguous(), "the trap needs preprocess's strided layout"
    assert torch.equal(strided["mid_block_res_sample"], dense["mid_block_res_sample"])
    pairs = zip(strided["down_block_res_samples"], dense["down_block_res_samples"], strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_build_is_idempotent_and_its_random_weights_are_not_zero_where_init_would_zero_them(h: Sd) -> None:
    from diffusers import ControlNetModel
    from safetensors.torch import load_file

    root, style = h.root, h.root / SD_LORAS["style"]
    manifests = [
        root / "tiny-sd15" / tiny_sd.MANIFEST,
        root / "tiny-sd15-controlnet" / tiny_sd.MANIFEST,
        tiny_sd.lora_manifest_path(style),
    ]
    before = [m.stat().st_mtime_ns for m in manifests]

    built = tiny_sd.build(root)

    assert built == {
        "tiny-sd15": root / "tiny-sd15",
        "tiny-sd15-controlnet": root / "tiny-sd15-controlnet",
        "tiny-sd15-style": style,
    }
    assert [m.stat().st_mtime_ns for m in manifests] == before
    assert tiny_sd.read_manifest(manifests[0]) == {"family": "sd15", "kind": "pipeline", "seed": 0}
    controlnet = ControlNetModel.from_pretrained(root / "tiny-sd15-controlnet")
    assert all(block.weight.abs().sum() > 0 for block in controlnet.controlnet_down_blocks)
    assert controlnet.controlnet_mid_block.weight.abs().sum() > 0
    lora = load_file(str(style))
    lora_b = [v for k, v in lora.items() if "lora_B" in k]
    assert lora_b and all(v.abs().sum() > 0 for v in lora_b)
    assert all(k.startswith("unet.") for k in lora)
