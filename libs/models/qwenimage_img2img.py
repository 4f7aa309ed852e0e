"""The Qwen-Image ModelFns of the pipelines that start from pictures: what
``QwenImageImg2ImgPipeline.__call__`` ("I2I", ``diffusers/pipelines/qwenimage/pipeline_qwenimage_img2img.py``)
and ``QwenImageInpaintPipeline.__call__`` ("INP", ``pipeline_qwenimage_inpaint.py``), diffusers 0.42.1,
do beyond ``QwenImagePipeline``, and the instruction edits' encoders (below). The rest of these
workflows is :mod:`libs.models.qwenimage`'s (``qwenimage.text_encoder``, ``qwenimage.transformer``,
``qwenimage.scheduler_step``, ``qwenimage.vae_decode``): I2I's and INP's ``encode_prompt`` and loop
body are ``QwenImagePipeline``'s.

=============================  ==================================================================
ModelFn (``fn_name``)          what it mirrors
=============================  ==================================================================
``qwenimage.vae_encode``       I2I step 2 (``image_processor.preprocess``), step 4 (sigmas, ``mu``,
                               ``retrieve_timesteps``, ``get_timesteps``) and ``prepare_latents``:
                               the picture as a one-frame video [1, 3, 1, H, W], the posterior
                               sampled with the generator, ``_encode_vae_image``'s normalisation
                               ``(x - latents_mean) * (1 / latents_std)``, the frame axis moved
                               behind the channels, noise from the same generator, ``scale_noise``
                               at the first timestep run, packing
``qwenimage.inpaint_latents``  the same for INP, which also returns the packed ``noise`` and
                               image latents (``init_latents``), and the mask of ``mask_processor`` and
                               ``prepare_mask_latents`` (resized to the latents, nearest, repeated
                               over the channels, packed)
``qwenimage.inpaint_blend``    INP's lines after each ``scheduler.step``: the image latents
                               re-noised with ``scale_noise`` to the next timestep, then
                               ``(1 - init_mask) * init_latents_proper + init_mask * latents``
=============================  ==================================================================

The instruction edits' nodes, of ``QwenImageEditPipeline`` ("EDIT", ``pipeline_qwenimage_edit.py``)
and ``QwenImageEditPlusPipeline`` ("PLUS", ``pipeline_qwenimage_edit_plus.py``, several pictures):

====================================  ===========================================================
``qwenimage.edit_text_encoder``       EDIT's ``encode_prompt``: the VL processor with the picture
                                      resized by step 3 (``calculate_dimensions``: a 1024x1024 area
                                      at its aspect ratio, multiples of 32)
``qwenimage.edit_image_encode``       EDIT's step 3 (that resize, ``preprocess``) and the image half
                                      of ``prepare_latents`` (``_encode_vae_image``: the posterior's
                                      mode, mean/std, packing); ``image_shape`` [1, 2]
``qwenimage.edit_plus_text_encoder``  PLUS's ``encode_prompt``: "Picture i: <vision tokens>" per
                                      picture before the prompt, each picture resized to a 384x384
                                      area (``CONDITION_IMAGE_SIZE``)
``qwenimage.edit_plus_image_encode``  PLUS's pictures preprocessed straight to a 1024x1024 area, each
                                      encoded and packed, concatenated along the sequence;
                                      ``image_shape`` [k, 2]
====================================  ===========================================================

The edits' pictures are ``image`` and (PLUS) ``image_2``, ``image_3`` where given: PLUS takes a
list of any length, three here (the edits route takes at most that many uploads per workflow). The
pipelines' default output size (EDIT: the picture's resized size; PLUS: the *last* picture's) is not
offered: ``height`` and ``width`` are the request's, floored to multiples of 16 as both floor them.
The edits' ``encode_prompt`` ignores ``max_sequence_length``.

``init_latents`` is INP's ``image_latents`` under another name: ``qwenimage.transformer`` binds an
``image_latents`` by name (the instruction edit's), which inpainting must not feed it.

The schedule, as Flux's (:mod:`libs.models.flux_img2img`): ``get_timesteps`` skips the first
``int(n - n * strength)`` steps, so the loop has ``fraction="strength"`` and ``rounding="start"`` and
its index stays a position in the whole schedule; ``timesteps`` is the whole schedule and
``qwenimage.scheduler_step`` pins ``set_begin_index(step)``, the pipelines'
``set_begin_index(t_start)`` advanced by the iteration. ``scale_noise`` reads
``sigmas[step_index]`` (``sigmas[begin_index]`` before the first step), which
``qwenimage.inpaint_blend`` pins with ``set_begin_index(step + 1)`` on a fresh scheduler.

Dtypes: the picture, the noise and the mask take ``prompt_embeds.dtype`` (the text encoder's).
Generator: one ``torch.Generator().manual_seed(seed)``, the posterior's sample first, then the noise
(INP's encoding of the masked picture is a third draw that feeds nothing: skipped). Mask convention:
diffusers', white (>= 0.5) repainted. Not mirrored: ``padding_mask_crop``, user-given ``latents``,
``masked_image_latents`` or image latents as ``image``, custom ``sigmas``. No torch or diffusers at
import time.
"""

from __future__ import annotations

from typing import Any

from libs.models.common import FlowMatchInpaintBlend, config_dtype, load_component, run_dtype, with_loads
from libs.models.qwenimage import QwenImageTextEncoder, _embeds_and_mask, _masked_embeds
from libs.models.qwenimage_latents import (
    _latent_size,
    _latents_stats,
    _pack_latents,
    _scheduler,
    _set_timesteps,
    _vae_config,
    _vae_scale_factor,
)
from libs.models.qwenimage_loading import vl_processor
from libs.workflow.dag import tail_start
from libs.workflow.modelfn import ModelFn


def _prepared(components: dict[str, Any], inputs: dict[str, Any]) -> dict[str, Any]:
    """I2I/INP steps 2-5: the schedule and the packed ``latents``, ``noise`` and ``init_latents``
    (``prepare_latents``' ``image_latents``)."""
    import torch
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_img2img import retrieve_latents
    from diffusers.utils.torch_utils import randn_tensor

    vae, dtype, channels = components["vae"], components["latents_dtype"], components["num_channels_latents"]
    steps, height, width = int(inputs["num_inference_steps"]), int(inputs["height"]), int(inputs["width"])
    lh, lw = _latent_size(height, width, components["vae_scale_factor"])
    # 2. Preprocess image
    init_image = components["image_processor"].preprocess(inputs["image"], height=height, width=width)
    init_image = init_image.to(dtype=torch.float32)
    # 4. Prepare timesteps: retrieve_timesteps with the sigmas and mu, then get_timesteps
    scheduler = _scheduler(components["scheduler_config"])
    _set_timesteps(scheduler, steps, (lh // 2) * (lw // 2), device="cpu")
    t_start = tail_start(steps, float(inputs["strength"]), "start")
    if t_start >= steps:
        raise ValueError(
            f"strength {inputs['strength']} leaves none of the {steps} steps (num_inference_steps * strength < 1)"
        )
    scheduler.set_begin_index(t_start)
    latent_timestep = scheduler.timesteps[t_start : t_start + 1]
    # 5. prepare_latents: a one-frame video; the generator's first draw samples the posterior
    generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
    image = init_image.unsqueeze(2).to(device=vae.device, dtype=dtype)
    image_latents = retrieve_latents(vae.encode(image), generator=generator)
    mean, std = _latents_stats(vae.config, image_latents)
    image_latents = (image_latents - mean) * (1.0 / std)
    image_latents = torch.cat([image_latents], dim=0).transpose(1, 2)
    noise = randn_tensor(
        (1, 1, channels, lh, lw), generator=generator, device=image_latents.device, dtype=dtype
    )
    latents = scheduler.scale_noise(image_latents, latent_timestep, noise)
    return {
        "latents": _pack_latents(latents, channels, lh, lw),
        "noise": _pack_latents(noise, channels, lh, lw),
        "init_latents": _pack_latents(image_latents, channels, lh, lw),
        "timesteps": scheduler.timesteps,
    }


class QwenImageVaeEncode(ModelFn):
    """img2img's initial latents: ``latents`` [1, seq, 4C] (packed), the encoded picture noised to
    the first timestep run, and ``timesteps``, the whole schedule."""

    fn_name = "qwenimage.vae_encode"
    outputs_kept: tuple[str, ...] = ("latents", "timesteps")

    def setup_io(self) -> None:
        self.add_input("image")
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_input("strength")
        for name in self.outputs_kept:
            self.add_output(name)

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import (
            AutoencoderKLQwenImage,
            FlowMatchEulerDiscreteScheduler,
            QwenImageTransformer2DModel,
        )
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKLQwenImage, model_path, "vae", device, loader)
        factor = _vae_scale_factor(vae.config)
        latent_channels = int(vae.config.z_dim)
        transformer_config = QwenImageTransformer2DModel.load_config(model_path, subfolder="transformer")
        scheduler_config = dict(
            FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler")
        )
        _scheduler(scheduler_config)  # refuse a stochastic one at load time
        return with_loads(
            {
                "vae": vae,
                "vae_scale_factor": factor,
                # I2I/INP __init__: packing doubles the effective scale factor
                "image_processor": VaeImageProcessor(
                    vae_scale_factor=factor * 2, vae_latent_channels=latent_channels
                ),
                "mask_processor": VaeImageProcessor(
                    vae_scale_factor=factor * 2,
                    vae_latent_channels=latent_channels,
                    do_normalize=False,
                    do_binarize=True,
                    do_convert_grayscale=True,
                ),
                "num_channels_latents": int(transformer_config["in_channels"]) // 4,
                "scheduler_config": scheduler_config,
                # prepare_latents(..., prompt_embeds.dtype, ...): the text encoder's dtype
                "latents_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        with torch.no_grad():
            prepared = _prepared(components, inputs)
        return {name: prepared[name] for name in self.outputs_kept}


class QwenImageInpaintLatents(QwenImageVaeEncode):
    """Inpainting's preparation: ``qwenimage.vae_encode``'s outputs, and what every step's blend
    reads: the packed image latents ``init_latents`` and ``noise``, and ``init_mask`` [1, seq, 4C], the binarised
    mask resized to the latents (nearest), repeated over the channels and packed."""

    fn_name = "qwenimage.inpaint_latents"
    outputs_kept = ("latents", "timesteps", "init_latents", "noise")

    def setup_io(self) -> None:
        self.add_input("mask")
        super().setup_io()
        self.add_output("init_mask")

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        height, width = int(inputs["height"]), int(inputs["width"])
        lh, lw = _latent_size(height, width, components["vae_scale_factor"])
        with torch.no_grad():
            out = super().execute(components, **inputs)
            # prepare_mask_latents: resized before the cast, then repeated over the channels and packed
            mask = components["mask_processor"].preprocess(inputs["mask"], height=height, width=width)
            mask = torch.nn.functional.interpolate(mask, size=(lh, lw))
            mask = mask.to(device=out["latents"].device, dtype=components["latents_dtype"])
            channels = components["num_channels_latents"]
            out["init_mask"] = _pack_latents(mask.repeat(1, channels, 1, 1), channels, lh, lw)
        return out


class QwenImageInpaintBlend(FlowMatchInpaintBlend):
    """After step ``step``'s Euler update: ``latents`` = ``(1 - init_mask) * init_latents_proper +
    init_mask * latents``, ``init_latents_proper`` the image latents noised to the next timestep
    (as they are at the last step). Needs configs only."""

    fn_name = "qwenimage.inpaint_blend"
    image_input = "init_latents"

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler

        config = dict(FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler"))
        _scheduler(config)
        return {"scheduler_config": config}

    def scheduler(self, components: dict[str, Any], num_inference_steps: int, latents: Any) -> Any:
        scheduler = _scheduler(components["scheduler_config"])
        _set_timesteps(scheduler, num_inference_steps, latents.shape[1], device=latents.device)
        return scheduler


# -- the instruction edits: QwenImageEditPipeline and QwenImageEditPlusPipeline --------------------


def calculate_dimensions(target_area: float, ratio: float) -> tuple[int, int]:
    """The edit pipelines' resize rule: (width, height) of ``target_area`` pixels at aspect ratio
    ``ratio`` (w / h), each rounded to a multiple of 32 (``calculate_dimensions``, same operations)."""
    import math

    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


def _edit_size(image: Any, area: int = 1024 * 1024) -> tuple[int, int]:
    """(height, width) of ``image`` resized to ``area`` pixels at its aspect ratio."""
    width, height = calculate_dimensions(area, image.size[0] / image.size[1])
    return height, width


def _pictures(inputs: dict[str, Any]) -> list[Any]:
    """The edit's pictures in order: ``image``, then ``image_2`` and ``image_3`` where given."""
    pictures = [inputs["image"]] + [inputs.get(name) for name in EXTRA_PICTURES]
    if pictures[0] is None:
        raise ValueError("an instruction edit needs an image")
    return [p for p in pictures if p is not None]


EXTRA_PICTURES = ("image_2", "image_3")  # QwenImageEditPlusPipeline's further pictures, here at most 3
CONDITION_AREA = 384 * 384  # the Plus pipeline's CONDITION_IMAGE_SIZE: the pictures the VL model sees
VAE_AREA = 1024 * 1024  # both pipelines' VAE picture area (the Plus pipeline's VAE_IMAGE_SIZE)


class QwenImageEditTextEncoder(QwenImageTextEncoder):
    """The edit's VL prompt encoding (``QwenImageEditPipeline.encode_prompt``): the prompt with the
    input ``image`` (resized by the edit's rule) through the VL processor; no truncation."""

    fn_name = "qwenimage.edit_text_encoder"
    pipeline = "QwenImageEditPipeline"

    def setup_io(self) -> None:
        super().setup_io()
        self.add_input("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers.image_processor import VaeImageProcessor

        components = super().load_model(model_path, device, loader)
        components["processor"] = vl_processor(model_path)
        factor = _vae_scale_factor(_vae_config(model_path))
        components["image_processor"] = VaeImageProcessor(vae_scale_factor=factor * 2)
        return components

    def _picture_prompt(self, image: Any) -> str:
        """What goes before the prompt in the template (the Plus pipeline numbers its pictures)."""
        return ""

    def _encode(self, components: dict[str, Any], prompt: str, max_length: int, image: Any) -> Any:
        text_encoder, drop_idx = components["text_encoder"], components["drop_idx"]
        txt = [components["template"].format(self._picture_prompt(image) + prompt)]
        inputs = components["processor"](text=txt, images=image, padding=True, return_tensors="pt").to(
            text_encoder.device
        )
        out = text_encoder(
            input_ids=inputs["input_ids"],
            attention_mask=inputs["attention_mask"],
            pixel_values=inputs.get("pixel_values"),
            image_grid_thw=inputs.get("image_grid_thw"),
            output_hidden_states=True,
        )
        kept = _masked_embeds(out.hidden_states[-1], inputs["attention_mask"], drop_idx)
        return _embeds_and_mask(kept, text_encoder.dtype, text_encoder.device)

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        image = inputs["image"]
        height, width = _edit_size(image)
        # step 3: prompt_image = image_processor.resize(image, calculated_height, calculated_width)
        prompt_image = components["image_processor"].resize(image, height, width)
        return super().execute(components, **{**inputs, "image": prompt_image})


class QwenImageEditPlusTextEncoder(QwenImageEditTextEncoder):
    """``QwenImageEditPlusPipeline.encode_prompt``: the prompt after "Picture 1: <vision>…" for each
    of up to three pictures, each resized to a 384x384 area at its aspect ratio; no truncation."""

    fn_name = "qwenimage.edit_plus_text_encoder"
    pipeline = "QwenImageEditPlusPipeline"

    def setup_io(self) -> None:
        super().setup_io()
        for name in EXTRA_PICTURES:
            self.add_input(name, optional=True)

    def _picture_prompt(self, image: Any) -> str:
        # _get_qwen_prompt_embeds' img_prompt_template, numbered from 1
        return "".join(
            f"Picture {i + 1}: <|vision_start|><|image_pad|><|vision_end|>" for i in range(len(image))
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        resize = components["image_processor"].resize
        # the loop over the pictures: condition_images
        conditions = [resize(p, *_edit_size(p, CONDITION_AREA)) for p in _pictures(inputs)]
        return QwenImageTextEncoder.execute(self, components, **{**inputs, "image": conditions})


class QwenImageEditImageEncode(ModelFn):
    """The edit's input image as packed latents: ``image_latents`` [1, seq, 4z] and ``image_shape``
    (int64 [k, 2]: each picture's packed grid height and width, ``img_shapes``' entries after the
    noise's; k = 1 here)."""

    fn_name = "qwenimage.edit_image_encode"

    def setup_io(self) -> None:
        self.add_input("image")
        self.add_output("image_latents")
        self.add_output("image_shape")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKLQwenImage
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKLQwenImage, model_path, "vae", device, loader)
        factor = _vae_scale_factor(vae.config)
        return with_loads(
            {
                "vae": vae,
                "vae_scale_factor": factor,
                "image_processor": VaeImageProcessor(vae_scale_factor=factor * 2),
                # prepare_latents: image.to(dtype=prompt_embeds.dtype), the text encoder's
                "dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
            }
        )

    def _pixels(self, processor: Any, image: Any, height: int, width: int) -> Any:
        """Step 3's preprocessing of one picture, [1, 3, 1, H, W]."""
        return processor.preprocess(processor.resize(image, height, width), height, width).unsqueeze(2)

    def _pictures(self, inputs: dict[str, Any]) -> list[Any]:
        return [inputs["image"]]

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import retrieve_latents

        vae, processor, factor = (
            components["vae"],
            components["image_processor"],
            components["vae_scale_factor"],
        )
        packed, shapes = [], []
        with torch.no_grad():
            for picture in self._pictures(inputs):
                height, width = _edit_size(picture, VAE_AREA)
                # 3. Preprocess image; 4. prepare_latents, the image half: _encode_vae_image (the
                # posterior's mode, no draw), normalised, then packed
                image = self._pixels(processor, picture, height, width)
                image = image.to(device=vae.device, dtype=components["dtype"])
                latents = retrieve_latents(vae.encode(image), sample_mode="argmax")
                mean, std = _latents_stats(vae.config, latents)
                latents = (latents - mean) / std
                latents = torch.cat([latents], dim=0)
                lh, lw = latents.shape[3:]
                packed.append(_pack_latents(latents, latents.shape[1], lh, lw))
                shapes.append([height // factor // 2, width // factor // 2])
            # the Plus pipeline: torch.cat(all_image_latents, dim=1)
            image_latents = torch.cat(packed, dim=1)
        return {"image_latents": image_latents, "image_shape": torch.tensor(shapes, dtype=torch.int64)}


class QwenImageEditPlusImageEncode(QwenImageEditImageEncode):
    """``QwenImageEditPlusPipeline``'s pictures (up to three) as packed latents one after the other,
    each preprocessed straight to a 1024x1024 area at its aspect ratio (no separate resize)."""

    fn_name = "qwenimage.edit_plus_image_encode"

    def setup_io(self) -> None:
        super().setup_io()
        for name in EXTRA_PICTURES:
            self.add_input(name, optional=True)

    def _pixels(self, processor: Any, image: Any, height: int, width: int) -> Any:
        return processor.preprocess(image, height, width).unsqueeze(2)

    def _pictures(self, inputs: dict[str, Any]) -> list[Any]:
        return _pictures(inputs)
