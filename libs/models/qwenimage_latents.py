"""Qwen-Image's latent space and schedule, as its pipelines compute them: the VAE's scale factor and
config, the prompt template's drop length, the packed latent layout (2x2 patches of a 5-D video
latent), the VAE's latents mean/std, and the flow-matching schedule with ``calculate_shift``'s
``mu``, and two request checks (the maximum sequence length, true CFG). Shared by the text-to-image,
edit and img2img/inpaint ModelFns
(:mod:`libs.models.qwenimage`, :mod:`libs.models.qwenimage_img2img`).

No torch, diffusers or transformers at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import calculate_shift

if TYPE_CHECKING:
    import torch


def _vae_scale_factor(vae_config: Any) -> int:
    # QwenImagePipeline.__init__: 2 ** len(vae.temperal_downsample)
    return int(2 ** len(vae_config["temperal_downsample"]))


def _vae_config(model_path: str) -> dict[str, Any]:
    from diffusers import AutoencoderKLQwenImage

    return dict(AutoencoderKLQwenImage.load_config(model_path, subfolder="vae"))


def _template(pipeline: str) -> tuple[str, int, int]:
    """``prompt_template_encode``, ``prompt_template_encode_start_idx`` and ``tokenizer_max_length``
    as the pipeline's ``__init__`` sets them (built without components: nothing is copied here)."""
    import diffusers

    components = dict.fromkeys(("scheduler", "vae", "text_encoder", "tokenizer", "transformer"))
    if pipeline in ("QwenImageEditPipeline", "QwenImageEditPlusPipeline"):
        components["processor"] = None
    pipe = getattr(diffusers, pipeline)(**components)
    return (
        pipe.prompt_template_encode,
        int(pipe.prompt_template_encode_start_idx),
        int(pipe.tokenizer_max_length),
    )


def _check_max_sequence_length(value: Any) -> int:
    n = int(value)
    if not 1 <= n <= 1024:  # check_inputs
        raise ValueError(f"`max_sequence_length` must be in [1, 1024] but is {n}")
    return n


def _do_true_cfg(true_cfg_scale: Any) -> bool:
    # do_true_cfg = true_cfg_scale > 1 and has_neg_prompt (workflows always pass a negative prompt)
    return float(true_cfg_scale) > 1


def _latent_size(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    # prepare_latents / _unpack_latents: packing needs an even latent height and width
    return 2 * (int(height) // (vae_scale_factor * 2)), 2 * (int(width) // (vae_scale_factor * 2))


def _pack_latents(latents: torch.Tensor, channels: int, height: int, width: int) -> torch.Tensor:
    """``_pack_latents``: [1, 1, C, H, W] -> [1, (H/2)*(W/2), 4C], each 2x2 patch one token."""
    latents = latents.view(1, channels, height // 2, 2, width // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(1, (height // 2) * (width // 2), channels * 4)


def _unpack_latents(latents: torch.Tensor, height: int, width: int, vae_scale_factor: int) -> torch.Tensor:
    """``_unpack_latents``: back to the 5-D [1, C, 1, H, W] the VAE decodes."""
    b, _, channels = latents.shape
    lh, lw = _latent_size(height, width, vae_scale_factor)
    latents = latents.view(b, lh // 2, lw // 2, channels // 4, 2, 2)
    latents = latents.permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // (2 * 2), 1, lh, lw)


def _latents_stats(vae_config: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``latents_mean`` and ``latents_std`` as [1, z, 1, 1, 1] on ``like``'s device and dtype."""
    import torch

    z = int(vae_config["z_dim"])
    mean = torch.tensor(vae_config["latents_mean"]).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    std = torch.tensor(vae_config["latents_std"]).view(1, z, 1, 1, 1).to(like.device, like.dtype)
    return mean, std


def _set_timesteps(scheduler: Any, num_inference_steps: int, image_seq_len: int, device: Any) -> None:
    """Step 5: sigmas ``linspace(1, 1/n, n)``, ``mu`` from the packed sequence length, then
    ``retrieve_timesteps``' sigmas branch."""
    import numpy as np

    n = int(num_inference_steps)
    config = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / n, n), device=device, mu=mu)


def _scheduler(config: dict[str, Any]) -> Any:
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_config(config)
    if scheduler.config.get("stochastic_sampling", False):
        raise ValueError("qwenimage: stochastic_sampling draws from the generator; not supported")
    return scheduler
