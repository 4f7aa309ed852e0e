"""The Sana model family as five ModelFns: diffusers' ``SanaPipeline.__call__`` and
``SanaControlNetPipeline.__call__`` cut at their seams.

Each class mirrors one stretch of ``diffusers/pipelines/sana/pipeline_sana.py`` or
``pipeline_sana_controlnet.py`` (diffusers 0.42.1) and runs it on its own, so a workflow of these nodes reproduces the monolithic pipelines' images bitwise. The
two ControlNet-only nodes, ``sana.control_encode`` and ``sana.controlnet``, live in
:mod:`libs.models.sana_controlnet`:

============================  ===================================================================
ModelFn (``fn_name``)         what it mirrors
============================  ===================================================================
``sana.text_encoder``         ``encode_prompt`` + ``_get_gemma_prompt_embeds`` and the
                              ``[negative, positive]`` concatenation of ``__call__``'s step 3
``sana.prepare_latents``      resolution binning (``__call__``'s first lines), ``check_inputs``'
                              multiple-of-32 rule, step 4 ``retrieve_timesteps`` and step 5
                              ``prepare_latents``
``sana.transformer``          the loop body up to ``noise_pred``: CFG batching, timestep, the
                              transformer, ``.float()``, guidance, learned sigma
``sana.scheduler_step``       the loop's ``self.scheduler.step(noise_pred, t, latents)``, stateless
``sana.vae_decode``           the tail: ``vae.decode``, ``resize_and_crop_tensor``, postprocess
============================  ===================================================================

The denoising loop is the workflow's. Batch size and ``num_images_per_prompt`` are 1 (the platform
never batches requests: batching changes the bits); ``clean_caption`` (needs bs4 + ftfy),
user-supplied embeddings/latents, custom ``timesteps``/``sigmas`` and step callbacks are not
mirrored. Everything else follows the pipelines' defaults, decided as they decide them:

* ``complex_human_instruction``: the pipeline's default is a non-empty instruction list, so by
  default the prompt (not the negative prompt, which ``encode_prompt`` encodes with
  ``complex_human_instruction=False``) is prefixed with it and ``select_index`` keeps ``<bos>`` plus
  the last ``max_sequence_length - 1`` tokens. The list is read from ``SanaPipeline.__call__``'s
  signature, not copied. The ``complex_human_instruction`` input switches it off (``False``).
* ``use_resolution_binning`` (default on): height/width snap to the aspect-ratio bin table of the
  transformer's ``sample_size``; the decoded image is resized and centre-cropped back. Off, the
  image is generated at height x width exactly (each a multiple of 32).
* Classifier-free guidance iff ``guidance_scale > 1`` (``do_classifier_free_guidance``).

Stateless scheduler step. Consecutive steps of one request may run on different executors, so
``sana.scheduler_step`` rebuilds a fresh scheduler per call from the saved config, runs the
pipeline's ``set_timesteps(num_inference_steps, device)``, checks the schedule against the carried
``timesteps`` and pins ``set_begin_index(step)``. ``FlowMatchEulerDiscreteScheduler`` (diffusers'
tiny Sana tests) has no other state. ``DPMSolverMultistepScheduler`` (real Sana checkpoints) keeps a
history of converted model outputs between steps; it travels as the ``solver_history`` tensor
``[k, *latents.shape]`` (the last ``k = min(step, solver_order - 1)`` outputs, oldest first, empty
for Euler), restored into ``model_outputs`` with ``lower_order_nums = min(step, solver_order)``.
Stochastic variants (SDE DPM-Solver, Euler ``stochastic_sampling``) draw from the request's
generator inside ``step``; they are refused rather than silently diverging.

ControlNet residuals (the paper, §5.2). ``sana.transformer`` declares ``sana.controlnet``'s
``controlnet_block_samples`` as an optional callback input and hands the transformer a lazy list
(:func:`~libs.models.common.lazy_list`):
``SanaTransformer2DModel.forward`` adds sample ``i - 1`` after block ``i >= 1`` and first touches
the list (``len``) after block 1, so the fetch overlaps with the embeddings and two blocks. Note that
``SanaControlNetPipeline`` does not multiply the timestep by ``transformer.config.timestep_scale``
(``SanaPipeline``'s loop does); the transformer node mirrors whichever pipeline its workflow is
(1.0 in every released Sana, so the same bits).

LoRA. ``sana.transformer`` takes ``lora`` (a safetensors path, "" = none) and ``lora_scale`` and
switches adapters with :class:`~libs.models.lora.LoraSwitch` (never fused). The scale is applied the
pipeline's way, ``attention_kwargs={"scale": lora_scale}`` (``apply_lora_scale`` multiplies each
adapter's ``alpha / r`` by it), with the adapter itself at weight 1.0, so any ``alpha``/``r`` gives
the pipeline's bits. The loader (``_lora_loader``) hands ``LoraSwitch`` the state dict without the
adapter metadata that ``SanaPipeline.load_lora_weights`` passes on, so diffusers infers
``lora_alpha = r``: a LoRA saved with ``lora_alpha != r`` (in its metadata) would be scaled
differently from the pipeline. The switch restores the base weights' ``requires_grad`` flags
(``match_requires_grad``): they change Sana's bits, since ``F.linear`` on the transposed input that
the linear attention feeds ``to_out`` takes another path when the weight requires grad, and peft
freezes the base weights when an adapter loads. So a plain request on a warm executor runs with the
flags of a fresh ``SanaPipeline`` and a LoRA request with all frozen, as after ``load_lora_weights``.

Dtypes follow the pipelines as loaded by ``from_pretrained`` without ``torch_dtype``. Noise is drawn
in fp32 on the CPU from ``torch.Generator("cpu").manual_seed(seed)`` (its only draw), as
``prepare_latents(..., torch.float32, ...)`` with a CPU generator does on any device.

No torch, diffusers or transformers at import time: the registry reads ``signature()`` without
them. ``load_model`` puts the models on the device it is given.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.models.common import lazy_list, load_component, to_uint8_image, vae_scale_factor, with_loads
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


# -- helpers -------------------------------------------------------------------------------------


def _component_class(model_path: str, name: str) -> Any:
    """The class ``model_index.json`` names for component ``name``, as ``from_pretrained`` picks it."""
    import importlib

    library, class_name = json.loads((Path(model_path) / "model_index.json").read_text())[name]
    return getattr(importlib.import_module(library), class_name)


def _load(model_path: str, name: str) -> Any:
    return _component_class(model_path, name).from_pretrained(model_path, subfolder=name)


def _load_model(model_path: str, name: str, device: Any, loader: Any) -> Any:
    """A component with weights, through :func:`~libs.models.common.load_component`."""
    return load_component(_component_class(model_path, name), model_path, name, device, loader)


def _load_config(model_path: str, name: str) -> dict[str, Any]:
    return dict(_component_class(model_path, name).load_config(model_path, subfolder=name))


def _vae_scale_factor(vae_config: Any) -> int:
    # SanaPipeline.__init__: DC-AE's scale factor, from its encoder's blocks
    return vae_scale_factor(vae_config, "encoder_block_out_channels")


def _aspect_ratio_bin(sample_size: int) -> dict[str, list[float]]:
    """The bin table ``__call__`` picks from ``transformer.config.sample_size``."""
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_alpha import (
        ASPECT_RATIO_512_BIN,
        ASPECT_RATIO_1024_BIN,
    )
    from diffusers.pipelines.pixart_alpha.pipeline_pixart_sigma import ASPECT_RATIO_2048_BIN
    from diffusers.pipelines.sana.pipeline_sana import ASPECT_RATIO_4096_BIN

    bins = {
        128: ASPECT_RATIO_4096_BIN,
        64: ASPECT_RATIO_2048_BIN,
        32: ASPECT_RATIO_1024_BIN,
        16: ASPECT_RATIO_512_BIN,
    }
    if sample_size not in bins:
        raise ValueError("Invalid sample size")
    return bins[sample_size]


def _generation_size(
    height: int, width: int, use_resolution_binning: bool, sample_size: int
) -> tuple[int, int]:
    """The (height, width) the pipeline generates at: binned (``__call__``), then ``check_inputs``."""
    from diffusers.image_processor import PixArtImageProcessor

    height, width = int(height), int(width)
    if use_resolution_binning:
        ratios = _aspect_ratio_bin(int(sample_size))
        height, width = PixArtImageProcessor.classify_height_width_bin(height, width, ratios=ratios)
    if height % 32 != 0 or width % 32 != 0:
        raise ValueError(f"`height` and `width` have to be divisible by 32 but are {height} and {width}.")
    return height, width


def _do_cfg(guidance_scale: float) -> bool:
    # SanaPipeline.do_classifier_free_guidance
    return float(guidance_scale) > 1.0


def _scheduler(config: dict[str, Any]) -> Any:
    """A fresh scheduler of the saved class; refuses the variants whose ``step`` draws noise."""
    import diffusers

    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    name = type(scheduler).__name__
    if name == "FlowMatchEulerDiscreteScheduler":
        if scheduler.config.get("stochastic_sampling", False):
            raise ValueError(
                "sana.scheduler_step: stochastic_sampling draws from the generator; not supported"
            )
    elif name == "DPMSolverMultistepScheduler":
        if scheduler.config.algorithm_type not in ("dpmsolver", "dpmsolver++"):
            raise ValueError(
                f"sana.scheduler_step: algorithm_type {scheduler.config.algorithm_type!r} draws from the "
                "generator; only 'dpmsolver' and 'dpmsolver++' are supported"
            )
    else:
        raise ValueError(
            f"sana.scheduler_step supports FlowMatchEulerDiscreteScheduler and DPMSolverMultistepScheduler, not {name}"
        )
    return scheduler


def _lora_loader(path: str) -> tuple[dict[str, Any], str | None]:
    """``SanaLoraLoaderMixin.load_lora_weights``' reading of a LoRA file, for ``LoraSwitch``."""
    from diffusers.loaders import SanaLoraLoaderMixin

    state_dict = SanaLoraLoaderMixin.lora_state_dict(path)
    if not all("lora" in key for key in state_dict):
        raise ValueError(
            "Invalid LoRA checkpoint. Make sure all LoRA param names contain `'lora'` substring."
        )
    return state_dict, "transformer"


# -- the ModelFns --------------------------------------------------------------------------------


class SanaTextEncoder(ModelFn):
    """Gemma2 prompt encoding: ``prompt_embeds`` [B, max_sequence_length, hidden] and
    ``prompt_attention_mask`` [B, max_sequence_length] (int64), with B = 2 ``[negative, prompt]``
    when guiding (``guidance_scale > 1``), else B = 1."""

    fn_name = "sana.text_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("negative_prompt")
        self.add_input("guidance_scale")
        self.add_input("max_sequence_length")
        self.add_input("complex_human_instruction")
        self.add_output("prompt_embeds")
        self.add_output("prompt_attention_mask")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        import inspect

        from diffusers import SanaPipeline

        default = inspect.signature(SanaPipeline.__call__).parameters["complex_human_instruction"].default
        return with_loads(
            {
                "tokenizer": _load(model_path, "tokenizer"),
                "text_encoder": _load_model(model_path, "text_encoder", device, loader),
                "complex_human_instruction": list(default),
            }
        )

    @staticmethod
    def _gemma_prompt_embeds(
        components: dict[str, Any],
        prompt: str,
        max_sequence_length: int,
        complex_human_instruction: list[str] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``_get_gemma_prompt_embeds``, ``clean_caption=False``."""
        tokenizer, text_encoder = components["tokenizer"], components["text_encoder"]
        device, dtype = text_encoder.device, text_encoder.dtype
        prompts = [prompt]
        tokenizer.padding_side = "right"
        prompts = [p.lower().strip() for p in prompts]  # _text_preprocessing without clean_caption
        if not complex_human_instruction:
            max_length_all = max_sequence_length
        else:
            chi_prompt = "\n".join(complex_human_instruction)
            prompts = [chi_prompt + p for p in prompts]
            num_chi_prompt_tokens = len(tokenizer.encode(chi_prompt))
            max_length_all = num_chi_prompt_tokens + max_sequence_length - 2
        text_inputs = tokenizer(
            prompts,
            padding="max_length",
            max_length=max_length_all,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        prompt_attention_mask = text_inputs.attention_mask.to(device)
        prompt_embeds = text_encoder(text_inputs.input_ids.to(device), attention_mask=prompt_attention_mask)
        prompt_embeds = prompt_embeds[0].to(dtype=dtype, device=device)
        return prompt_embeds, prompt_attention_mask

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        max_length = int(inputs["max_sequence_length"])
        if max_length < 1:
            raise ValueError(f"max_sequence_length must be at least 1, got {max_length}")
        chi = components["complex_human_instruction"] if inputs["complex_human_instruction"] else None
        with torch.no_grad():
            # encode_prompt: keep token 0 and the last max_length - 1 tokens
            select_index = [0] + list(range(-max_length + 1, 0))
            prompt_embeds, prompt_attention_mask = self._gemma_prompt_embeds(
                components, str(inputs["prompt"]), max_length, chi
            )
            prompt_embeds = prompt_embeds[:, select_index]
            prompt_attention_mask = prompt_attention_mask[:, select_index]
            if _do_cfg(inputs["guidance_scale"]):
                # the negative prompt (encode_prompt): complex_human_instruction=False and no
                # select_index
                negative_prompt = inputs.get("negative_prompt") or ""
                negative_embeds, negative_mask = self._gemma_prompt_embeds(
                    components, str(negative_prompt), max_length, None
                )
                negative_embeds = negative_embeds.to(dtype=components["text_encoder"].dtype)
                # step 3 of __call__
                prompt_embeds = torch.cat([negative_embeds, prompt_embeds], dim=0)
                prompt_attention_mask = torch.cat([negative_mask, prompt_attention_mask], dim=0)
        return {"prompt_embeds": prompt_embeds, "prompt_attention_mask": prompt_attention_mask}


class SanaPrepareLatents(ModelFn):
    """Initial noise and schedule: ``latents`` [1, C, h/f, w/f] (fp32; h, w after binning),
    ``timesteps`` (the scheduler's) and an empty ``solver_history`` [0, *latents.shape].
    Needs configs only, no weights."""

    fn_name = "sana.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_input("use_resolution_binning")
        self.add_output("latents")
        self.add_output("timesteps")
        self.add_output("solver_history")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        transformer_config = _load_config(model_path, "transformer")
        return {
            "latent_channels": int(transformer_config["in_channels"]),
            "sample_size": int(transformer_config["sample_size"]),
            "vae_scale_factor": _vae_scale_factor(_load_config(model_path, "vae")),
            "scheduler_config": _load_config(model_path, "scheduler"),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers.utils.torch_utils import randn_tensor

        steps = int(inputs["num_inference_steps"])
        if steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1, got {steps}")
        height, width = _generation_size(
            inputs["height"],
            inputs["width"],
            bool(inputs["use_resolution_binning"]),
            components["sample_size"],
        )
        vsf = components["vae_scale_factor"]
        with torch.no_grad():
            # 4. Prepare timesteps: retrieve_timesteps -> set_timesteps(num_inference_steps, device)
            scheduler = _scheduler(components["scheduler_config"])
            scheduler.set_timesteps(steps, device="cpu")
            timesteps = scheduler.timesteps
            # 5. Prepare latents: the generator's only draw, fp32
            shape = (1, components["latent_channels"], int(height) // vsf, int(width) // vsf)
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            latents = randn_tensor(
                shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32
            )
        return {
            "latents": latents,
            "timesteps": timesteps,
            "solver_history": latents.new_empty((0, *latents.shape)),
        }


class SanaTransformer(ModelFn):
    """One denoising step of ``SanaTransformer2DModel`` with guidance: ``noise_pred`` [1, C, h, w]
    (fp32). Serves both pipelines: with ``controlnet_block_samples`` bound (a callback, fetched
    inside the forward) it is the ControlNet pipeline's step."""

    fn_name = "sana.transformer"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("prompt_embeds")
        self.add_input("prompt_attention_mask")
        self.add_input("controlnet_block_samples", callback=True, optional=True)
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_output("noise_pred")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from libs.models.lora import LoraSwitch

        transformer = _load_model(model_path, "transformer", device, loader)
        # match_requires_grad: the flags change Sana's bits (see the module docstring, "LoRA")
        return with_loads(
            {
                "transformer": transformer,
                "lora": LoraSwitch(transformer, _lora_loader, match_requires_grad=True),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        transformer = components["transformer"]
        device, transformer_dtype = transformer.device, transformer.dtype
        lora_path = inputs.get("lora") or ""
        lora_scale = inputs.get("lora_scale")
        lora_scale = 1.0 if lora_scale is None else float(lora_scale)
        # The adapter at weight 1.0 (scaling alpha / r, as after load_lora_weights); the request's
        # scale goes in as the pipeline passes it, attention_kwargs={"scale": ...}.
        components["lora"].use(lora_path, 1.0)
        attention_kwargs = {"scale": lora_scale} if lora_path else None
        control = inputs.get("controlnet_block_samples")
        guidance_scale = float(inputs["guidance_scale"])
        latents = inputs["latents"].to(device)
        latent_channels = transformer.config.in_channels
        with torch.no_grad():
            # 7./8. Denoising loop body (SanaPipeline's; SanaControlNetPipeline's)
            latent_model_input = torch.cat([latents] * 2) if _do_cfg(guidance_scale) else latents
            t = inputs["timesteps"].to(device)[int(inputs["step"])]
            timestep = t.expand(latent_model_input.shape[0])
            extra: dict[str, Any] = {}
            if control is None:
                timestep = timestep * transformer.config.timestep_scale  # SanaPipeline only
            else:
                # tuple(t.to(dtype=transformer_dtype) for t in controlnet_block_samples), fetched
                # when the forward first touches it (after block 1)
                extra["controlnet_block_samples"] = lazy_list(
                    control, lambda samples: [s.to(device=device, dtype=transformer_dtype) for s in samples]
                )
            noise_pred = transformer(
                latent_model_input.to(dtype=transformer_dtype),
                encoder_hidden_states=inputs["prompt_embeds"].to(device).to(dtype=transformer_dtype),
                encoder_attention_mask=inputs["prompt_attention_mask"].to(device),
                timestep=timestep,
                return_dict=False,
                attention_kwargs=attention_kwargs,
                **extra,
            )[0]
            noise_pred = noise_pred.float()
            if _do_cfg(guidance_scale):
                noise_pred_uncond, noise_pred_text = noise_pred.chunk(2)
                noise_pred = noise_pred_uncond + guidance_scale * (noise_pred_text - noise_pred_uncond)
            if transformer.config.out_channels // 2 == latent_channels:  # learned sigma
                noise_pred = noise_pred.chunk(2, dim=1)[0]
        return {"noise_pred": noise_pred}


class SanaSchedulerStep(ModelFn):
    """One scheduler step, stateless: ``latents`` of step ``step + 1`` and the ``solver_history``
    the next step needs (see the module docstring)."""

    fn_name = "sana.scheduler_step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_input("solver_history")
        self.add_output("latents")
        self.add_output("solver_history")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        config = _load_config(model_path, "scheduler")
        _scheduler(config)  # refuse an unsupported scheduler at load time
        return {"scheduler_config": config}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        latents = inputs["latents"]
        noise_pred = inputs["noise_pred"].to(latents.device)
        history = inputs["solver_history"].to(latents.device)
        step, steps = int(inputs["step"]), int(inputs["num_inference_steps"])
        with torch.no_grad():
            scheduler = _scheduler(components["scheduler_config"])
            scheduler.set_timesteps(steps, device=latents.device)
            timesteps = inputs["timesteps"].to(latents.device)
            if not torch.equal(scheduler.timesteps, timesteps):
                raise ValueError(f"timesteps do not match a {steps}-step schedule of this scheduler")
            if not 0 <= step < len(timesteps):
                raise ValueError(f"step {step} is outside the {len(timesteps)}-step schedule")
            scheduler.set_begin_index(step)
            order = (
                int(getattr(scheduler.config, "solver_order", 1))
                if hasattr(scheduler, "model_outputs")
                else 1
            )
            k = min(step, order - 1)
            if history.shape[0] != k or (k and history.shape[1:] != noise_pred.shape):
                raise ValueError(
                    f"solver_history has {history.shape[0]} entries of shape {tuple(history.shape[1:])}; "
                    f"step {step} of this scheduler needs {k} of shape {tuple(noise_pred.shape)}"
                )
            if hasattr(scheduler, "model_outputs"):
                # The multistep state the pipeline's scheduler has before step `step`.
                for j in range(k):
                    scheduler.model_outputs[order - k + j] = history[j]
                scheduler.lower_order_nums = min(step, order)
            # compute previous image: x_t -> x_t-1
            latents = scheduler.step(noise_pred, timesteps[step], latents, return_dict=False)[0]
            if hasattr(scheduler, "model_outputs"):
                kept = [m for m in scheduler.model_outputs[1:] if m is not None]
                history = torch.stack(kept) if kept else history[:0]
        return {"latents": latents, "solver_history": history}


class SanaVaeDecode(ModelFn):
    """Latents to pixels (``AutoencoderDC``): ``image``, a uint8 [H, W, 3] tensor equal to
    ``np.array`` of the pipeline's PIL image."""

    fn_name = "sana.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("height")
        self.add_input("width")
        self.add_input("use_resolution_binning")
        self.add_output("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers.image_processor import PixArtImageProcessor

        vae = _load_model(model_path, "vae", device, loader)
        return with_loads(
            {
                "vae": vae,
                "image_processor": PixArtImageProcessor(vae_scale_factor=_vae_scale_factor(vae.config)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        with torch.no_grad():
            # the tail of __call__
            latents = inputs["latents"].to(device=vae.device, dtype=vae.dtype)
            image = vae.decode(latents / vae.config.scaling_factor, return_dict=False)[0]
            if inputs["use_resolution_binning"]:
                # back to the requested size (a no-op when it is a bin size)
                image = image_processor.resize_and_crop_tensor(
                    image, int(inputs["width"]), int(inputs["height"])
                )
            return {"image": to_uint8_image(image_processor, image)}
