"""The Flux.2 Klein ModelFns that take pictures: what ``Flux2KleinInpaintPipeline.__call__`` ("INP",
``diffusers/pipelines/flux2/pipeline_flux2_klein_inpaint.py``, diffusers 0.42.1) does beyond
``Flux2KleinPipeline``, and ``Flux2KleinPipeline``'s own reference images (its ``image=``). The rest
of both workflows is :mod:`libs.models.flux2`'s (``flux2.text_encoder``, ``flux2.transformer``,
``flux2.scheduler_step``, ``flux2.vae_decode``; the edit's also ``flux2.prepare_latents``):

=============================  ==================================================================
ModelFn (``fn_name``)          what it mirrors
=============================  ==================================================================
``flux2.inpaint_latents``      INP steps 2, 5 and 6: ``image_processor.preprocess``, the timesteps
                               (``compute_empirical_mu``, ``retrieve_timesteps``, ``get_timesteps``),
                               ``prepare_latents`` (``_encode_vae_image``: the posterior's mode,
                               ``_patchify_latents``, the batch-norm statistics; noise, ``scale_noise``
                               at the first timestep run, packing, ``_prepare_latent_ids``),
                               ``prepare_image_latents``' ids for the picture as reference tokens
                               (``_prepare_image_ids``), ``mask_processor`` and
                               ``prepare_mask_latents`` (bilinear to the patch grid, packed)
``flux2.inpaint_blend``        INP's lines after each ``scheduler.step``: the image latents re-noised
                               with ``scale_noise`` to the next timestep, then
                               ``(1 - init_mask) * init_latents_proper + init_mask * latents``
``flux2.reference_encode``     ``Flux2KleinPipeline.__call__`` step 4 (its ``image``: the checks,
                               the resize over 1024 x 1024 pixels, the rounding down, ``preprocess``
                               with ``resize_mode="crop"``) and ``prepare_image_latents``
                               (``_encode_vae_image`` per picture, ``_prepare_image_ids``, packing)
                               for one to three pictures
=============================  ==================================================================

The reference tokens. INP hands ``prepare_image_latents`` the already encoded picture, which has
``latent_channels * 4`` channels and so is packed as it is: the transformer's condition latents are
the packed ``image_latents`` the blend reads, one output for both. Their ids have ``t = 10`` (the
first reference's offset). The loop body is ``flux2.transformer`` itself, which binds them by name
as its optional reference tokens (``torch.cat([latents, condition_image_latents], dim=1)``, their
ids after the latents', each pass cut back to the noisy tokens): one transformer for the plain and
the inpainting workflows.

The schedule. INP's ``get_timesteps`` is SD3's: it runs the last ``n - int(n - n * strength)``
steps, so the workflow's loop has ``fraction="strength"`` and ``rounding="start"`` and its index
stays a position in the whole schedule; ``set_begin_index(t_start)`` advanced by the iteration is
what ``flux2.scheduler_step``'s ``set_begin_index(step)`` gives. ``scale_noise`` reads
``sigmas[begin_index]`` before the first step and ``sigmas[step_index]`` after it;
``flux2.inpaint_blend`` pins ``begin_index`` at ``step + 1`` on a fresh scheduler for that sigma.

The picture. INP takes its size from the picture (rounded down to a multiple of twice the VAE's
scale factor; pictures over 1024 x 1024 pixels are first resized to that area) and ignores
``height`` and ``width``; ``flux2.inpaint_latents`` preprocesses the picture and the mask at the
request's ``height`` x ``width``, the same calls whenever those are the picture's rounded-down size
(the equality the tests check). Generator: the posterior's mode draws nothing, so the noise is the
generator's only draw. The noise, the picture and the mask take the prompt embeddings' dtype (the
text encoder's). Mask convention: diffusers', white (>= 0.5) repainted; the bilinear resize leaves
fractions on the mask's edges, as in INP. Not mirrored: ``image_reference`` (further reference
pictures), ``padding_mask_crop``, latents given as ``image``, user-given ``latents``, custom
``sigmas``.

Reference images (``tiny-flux2-klein-edit``). ``flux2.reference_encode`` prepares ``image``,
``image_2``, ``image_3`` (those given, in that order) as ``Flux2KleinPipeline`` prepares its
``image`` list: every picture is checked (``check_image_input``: 64 pixels a side at least, an
aspect ratio of 8 at most), one over 1024 x 1024 pixels is resized to that area (Lanczos), both
sides are rounded down to a multiple of twice the VAE's scale factor and ``preprocess`` crops to
them; each is encoded on its own in the VAE's dtype (the posterior's mode: no draw, so the noise
stays the generator's only draw) and their packed tokens are concatenated, the i-th picture's ids
at ``t = 10 + 10 * i``. ``flux2.transformer`` binds ``image_latents`` and ``image_latent_ids`` by
name, as inpainting's. The output size: the pipeline, given no ``height`` / ``width``, takes the
first picture's rounded size; the workflow always takes the request's ``height`` and ``width`` (the
workflow's defaults when the request names none), which is the pipeline called with them. No torch
or diffusers at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import (
    FlowMatchInpaintBlend,
    config_dtype,
    load_component,
    run_dtype,
    vae_scale_factor,
    with_loads,
)
from libs.models.flux2 import (
    _component_class,
    _latent_ids,
    _latent_size,
    _load_config,
    _load_vae,
    _set_klein_timesteps,
)
from libs.workflow.dag import tail_start
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch

# _prepare_image_ids: the time coordinate of the first reference picture, and the step between two
_REFERENCE_T = 10
# Flux2KleinPipeline.__call__: a reference picture over this area is first resized down to it
_MAX_REFERENCE_AREA = 1024 * 1024


def _patchify(latents: torch.Tensor) -> torch.Tensor:
    """``_patchify_latents``: [B, C, 2H, 2W] -> [B, 4C, H, W], each 2x2 patch a channel group."""
    b, c, h, w = latents.shape
    latents = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4)
    return latents.reshape(b, c * 4, h // 2, w // 2)


def _pack(latents: torch.Tensor) -> torch.Tensor:
    """``_pack_latents``: [B, C, H, W] -> [B, H*W, C]."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).permute(0, 2, 1)


def _image_ids(latents: list[torch.Tensor]) -> torch.Tensor:
    """``_prepare_image_ids`` for references of batch 1 ([1, C, H_i, W_i] each): [1, sum H_i*W_i, 4]
    int64 (t_i, row, column, 0), the i-th reference's time offset ``t_i = 10 + 10 * i``."""
    import torch

    ids = []
    for i, x in enumerate(latents):
        _, _, height, width = x.shape
        t = torch.tensor([_REFERENCE_T + _REFERENCE_T * i])
        ids.append(torch.cartesian_prod(t, torch.arange(height), torch.arange(width), torch.arange(1)))
    return torch.cat(ids, dim=0).unsqueeze(0)


def _encode_vae_image(vae: Any, image: torch.Tensor) -> torch.Tensor:
    """``_encode_vae_image``: the posterior's mode (no draw), ``_patchify_latents``, then normalised
    with the VAE's batch-norm statistics: [1, 4C, H, W] for a preprocessed picture on the VAE."""
    import torch
    from diffusers.pipelines.flux2.pipeline_flux2_klein import retrieve_latents

    image_latents = _patchify(retrieve_latents(vae.encode(image), sample_mode="argmax"))
    bn = vae.bn
    mean = bn.running_mean.view(1, -1, 1, 1).to(image_latents.device, image_latents.dtype)
    std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
        image_latents.device, image_latents.dtype
    )
    return (image_latents - mean) / std


def _condition_images(processor: Any, pictures: list[Any], vae_scale_factor: int) -> list[torch.Tensor]:
    """``Flux2KleinPipeline.__call__`` step 4 ("process images") for PIL ``pictures``: every one
    checked first, then each resized to 1024 x 1024 pixels' area when over it, its sides rounded
    down to a multiple of twice ``vae_scale_factor`` and ``preprocess``-ed to them (cropped)."""
    for img in pictures:
        processor.check_image_input(img)  # at least 64 px a side, an aspect ratio of at most 8
    condition_images = []
    multiple_of = vae_scale_factor * 2
    for img in pictures:
        image_width, image_height = img.size
        if image_width * image_height > _MAX_REFERENCE_AREA:
            img = processor._resize_to_target_area(img, _MAX_REFERENCE_AREA)  # noqa: SLF001 - as __call__ does
            image_width, image_height = img.size
        image_width = (image_width // multiple_of) * multiple_of
        image_height = (image_height // multiple_of) * multiple_of
        condition_images.append(
            processor.preprocess(img, height=image_height, width=image_width, resize_mode="crop")
        )
    return condition_images


class Flux2InpaintLatents(ModelFn):
    """Inpainting's preparation: ``latents`` [1, h*w, 4C] (the encoded picture noised to the first
    timestep run, packed), ``latent_ids``, ``timesteps`` (the whole schedule), and what the steps
    read: the packed ``image_latents`` and their ``image_latent_ids``, the packed ``noise`` and
    ``init_mask`` [1, h*w, 1]."""

    fn_name = "flux2.inpaint_latents"

    def setup_io(self) -> None:
        for name in ("image", "mask", "seed", "height", "width", "num_inference_steps", "strength"):
            self.add_input(name)
        for name in ("latents", "latent_ids", "timesteps", "image_latents", "image_latent_ids", "noise"):
            self.add_output(name)
        self.add_output("init_mask")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

        vae = load_component(_component_class(model_path, "vae"), model_path, "vae", device, loader)
        factor = vae_scale_factor(vae.config)
        latent_channels = vae.config.latent_channels
        return with_loads(
            {
                "vae": vae,
                "vae_scale_factor": factor,
                # INP __init__: the processors work at twice the VAE's scale factor (the 2x2 patches)
                "image_processor": Flux2ImageProcessor(
                    vae_scale_factor=factor * 2, vae_latent_channels=latent_channels
                ),
                "mask_processor": Flux2ImageProcessor(
                    vae_scale_factor=factor * 2,
                    vae_latent_channels=latent_channels,
                    do_normalize=False,
                    do_binarize=True,
                    do_convert_rgb=False,
                    do_convert_grayscale=True,
                ),
                "num_channels_latents": int(_load_config(model_path, "transformer")["in_channels"]) // 4,
                "scheduler_config": _load_config(model_path, "scheduler"),
                # prepare_latents and prepare_mask_latents take prompt_embeds.dtype: the text encoder's
                "latents_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.utils.torch_utils import randn_tensor

        vae, dtype, factor = components["vae"], components["latents_dtype"], components["vae_scale_factor"]
        steps, height, width = int(inputs["num_inference_steps"]), int(inputs["height"]), int(inputs["width"])
        lh, lw = _latent_size(height, width, factor)
        if lh < 2 or lw < 2:
            raise ValueError(f"{height}x{width} is smaller than one latent patch")
        with torch.no_grad():
            # 2. Preprocess image
            init_image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
            # 5. Prepare timesteps, then get_timesteps
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_klein_timesteps(scheduler, steps, (lh // 2) * (lw // 2), device="cpu")
            t_start = tail_start(steps, float(inputs["strength"]), "start")
            if t_start >= steps:
                raise ValueError(
                    f"strength {inputs['strength']} leaves none of the {steps} steps "
                    "(num_inference_steps * strength < 1)"
                )
            scheduler.set_begin_index(t_start)
            latent_timestep = scheduler.timesteps[t_start : t_start + 1]
            # 6. prepare_latents: _encode_vae_image (the mode: no draw), then the generator's only draw
            image_latents = _encode_vae_image(vae, init_image.to(device=vae.device, dtype=dtype))
            shape = (1, components["num_channels_latents"] * 4, lh // 2, lw // 2)
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            noise = randn_tensor(shape, generator=generator, device=image_latents.device, dtype=dtype)
            latents = scheduler.scale_noise(image_latents, latent_timestep, noise)
            # mask_processor.preprocess, then prepare_mask_latents
            mask = components["mask_processor"].preprocess(inputs["mask"], height=height, width=width)
            mask = torch.nn.functional.interpolate(
                mask, size=(height // (factor * 2), width // (factor * 2)), mode="bilinear"
            )
            mask = mask.to(device=latents.device, dtype=dtype)
        return {
            "latents": _pack(latents),
            "latent_ids": _latent_ids(noise),
            "timesteps": scheduler.timesteps,
            "image_latents": _pack(image_latents),
            "image_latent_ids": _image_ids([image_latents]),
            "noise": _pack(noise),
            "init_mask": _pack(mask),
        }


class Flux2ReferenceEncode(ModelFn):
    """Klein's reference pictures as the transformer's reference tokens: the packed
    ``image_latents`` [1, N, 4C] of ``image`` and, when given, ``image_2`` and ``image_3`` (in that
    order, N the sum of their patch grids), and their ``image_latent_ids`` [1, N, 4] (int64)."""

    fn_name = "flux2.reference_encode"

    def setup_io(self) -> None:
        self.add_input("image")
        self.add_input("image_2", optional=True)
        self.add_input("image_3", optional=True)
        self.add_output("image_latents")
        self.add_output("image_latent_ids")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return _load_vae(model_path, device, loader)  # flux2.vae_decode's components

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae = components["vae"]
        pictures = [inputs[n] for n in ("image", "image_2", "image_3") if inputs.get(n) is not None]
        condition_images = _condition_images(
            components["image_processor"], pictures, components["vae_scale_factor"]
        )
        with torch.no_grad():
            # prepare_image_latents: each picture encoded on its own in the VAE's dtype, then packed
            latents = [
                _encode_vae_image(vae, image.to(device=vae.device, dtype=vae.dtype))
                for image in condition_images
            ]
            image_latents = torch.cat([_pack(x).squeeze(0) for x in latents], dim=0).unsqueeze(0)
        return {"image_latents": image_latents, "image_latent_ids": _image_ids(latents)}


class Flux2InpaintBlend(FlowMatchInpaintBlend):
    """After step ``step``'s Euler update: ``latents`` = ``(1 - init_mask) * init_latents_proper +
    init_mask * latents``, ``init_latents_proper`` the image latents noised to the next timestep
    (as they are at the last step; :class:`~libs.models.common.FlowMatchInpaintBlend`), on a
    scheduler with Klein's timesteps. Needs configs only."""

    fn_name = "flux2.inpaint_blend"

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return {"scheduler_config": _load_config(model_path, "scheduler")}

    def set_timesteps(
        self, components: dict[str, Any], scheduler: Any, num_inference_steps: int, latents: torch.Tensor
    ) -> None:
        _set_klein_timesteps(scheduler, num_inference_steps, latents.shape[1], device=latents.device)
