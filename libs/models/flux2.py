"""The Flux.2 Klein model family as five ModelFns: diffusers' ``Flux2KleinPipeline.__call__`` cut at
its seams.

Each class mirrors one stretch of ``diffusers/pipelines/flux2/pipeline_flux2_klein.py`` (diffusers
0.42.1) and runs it on its own, so a workflow of these nodes reproduces the pipeline's image bitwise
(measured by the family's tests on the CPU, one thread):

============================  ===================================================================
ModelFn (``fn_name``)         what it mirrors
============================  ===================================================================
``flux2.text_encoder``        step 3: ``encode_prompt`` / ``_get_qwen3_prompt_embeds`` (chat
                              template, the stacked hidden states) and ``_prepare_text_ids``, for
                              the prompt and, when guiding, the pipeline's empty negative prompt
``flux2.prepare_latents``     step 5 ``prepare_latents`` (noise, ``_prepare_latent_ids``,
                              ``_pack_latents``) and step 6 (sigmas, ``compute_empirical_mu``,
                              ``retrieve_timesteps``)
``flux2.transformer``         the loop body up to ``noise_pred``: the conditional pass, the
                              unconditional one and their combination when guiding, with LoRA
                              and, when bound, the reference tokens (``image_latents``)
``flux2.scheduler_step``      the loop's ``self.scheduler.step(noise_pred, t, latents)``, stateless
``flux2.vae_decode``          the tail: ``_unpack_latents_with_ids``, the batch-norm statistics,
                              ``_unpatchify_latents``, ``vae.decode``, postprocess
============================  ===================================================================

The denoising loop is the workflow's. Batch size and ``num_images_per_prompt`` are 1 (the platform
never batches requests: batching changes the bits). Reference images (``image=``, Klein's
multi-reference editing) are :mod:`libs.models.flux2_img2img`'s ``flux2.reference_encode``, whose
``image_latents`` / ``image_latent_ids`` ``flux2.transformer`` takes as optional inputs. Not
mirrored: user-supplied embeddings or latents, custom ``sigmas``, ``attention_kwargs`` other than
the LoRA scale, and step callbacks. ``Flux2KleinInpaintPipeline`` reuses these seams (its masked
latents enter between ``flux2.scheduler_step`` and the next transformer call, in
:mod:`libs.models.flux2_img2img`). Klein has no ControlNet pipeline
(:mod:`libs.models.flux2_controlnet`).

Classifier-free guidance. ``do_classifier_free_guidance`` is ``guidance_scale > 1 and not
is_distilled`` (``is_distilled`` from ``model_index.json``: false for Klein *base* checkpoints,
true for the step-distilled ones). When it holds, the pipeline also encodes the negative prompt
``""`` (always empty: Klein takes no ``negative_prompt``) and runs the transformer twice per step,
unbatched: once on the prompt (``cache_context("cond")``), once on the negative
(``cache_context("uncond")``), then ``neg + guidance_scale * (pos - neg)``. ``flux2.text_encoder``
then outputs ``prompt_embeds`` and ``text_ids`` with a batch of 2 (row 0 the prompt, row 1 the
negative, each encoded on its own as the pipeline does) and ``flux2.transformer`` runs its two
passes from the rows; both read ``is_distilled`` and the transformer refuses embeddings that do not
fit the request's guidance.

Text encoder. ``Qwen3ForCausalLM`` is used as an encoder: the pipeline stacks the hidden states of
``text_encoder_out_layers`` (default ``(9, 18, 27)``, read from ``__call__``'s signature) and never
uses the logits. The node runs the causal LM's decoder stack (``text_encoder.model``), whose
``hidden_states`` are the ones the causal LM returns, without the vocabulary projection (for
Qwen3-4B: 2560 x 151936 per token).

Stateless scheduler step. ``FlowMatchEulerDiscreteScheduler`` keeps ``sigmas`` and a
``_step_index`` between calls, but consecutive steps may run on different executors. Klein's
sigmas are a pure function of ``(num_inference_steps, mu)`` and ``mu`` of ``(latents.shape[1],
num_inference_steps)``, so the node carries ``(num_inference_steps, step)``, rebuilds a scheduler per
call with the pipeline's ``set_timesteps`` arguments, checks them against the carried ``timesteps``
and pins ``set_begin_index(step)``, as :mod:`libs.models.flux` does.

LoRA. ``flux2.transformer`` takes ``lora`` (a safetensors path, ``""`` = none) and ``lora_scale``; a
:class:`~libs.models.lora.LoraSwitch` loads each file the way ``Flux2LoraLoaderMixin`` does
(``lora_state_dict`` with its kohya/ai-toolkit/LoKr conversions and metadata, the format check,
``load_lora_adapter`` with ``network_alphas=None``) and sets the request's scale as
``set_adapters([name], [lora_scale])``; never fused.

Dtypes follow the pipeline as loaded by ``from_pretrained`` without ``torch_dtype``: the noise is
drawn in ``prompt_embeds.dtype``, i.e. the text encoder's (read from its config, or the executor's
dtype for it), on the CPU from ``torch.Generator("cpu").manual_seed(seed)``, its only draw.

No torch, diffusers or transformers at import time: the registry reads ``signature()`` without
them. ``load_model`` puts the models on the device it is given; ``flux2.prepare_latents`` runs on the
CPU, where the request's generator draws the noise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.models.common import (
    config_dtype,
    load_component,
    run_dtype,
    to_uint8_image,
    vae_scale_factor,
    with_loads,
)
from libs.models.lora import LoraSwitch
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


# -- helpers -------------------------------------------------------------------------------------


def _component_class(model_path: str, name: str) -> Any:
    """The class ``model_index.json`` names for component ``name``, as ``from_pretrained`` picks it."""
    import importlib

    library, class_name = json.loads((Path(model_path) / "model_index.json").read_text())[name]
    return getattr(importlib.import_module(library), class_name)


def _load_config(model_path: str, name: str) -> dict[str, Any]:
    return dict(_component_class(model_path, name).load_config(model_path, subfolder=name))


def _is_distilled(model_path: str) -> bool:
    """``Flux2KleinPipeline``'s ``is_distilled`` config, as ``from_pretrained`` passes it."""
    return bool(json.loads((Path(model_path) / "model_index.json").read_text()).get("is_distilled", False))


def _do_cfg(guidance_scale: float, is_distilled: bool) -> bool:
    # Flux2KleinPipeline.do_classifier_free_guidance
    return float(guidance_scale) > 1 and not is_distilled


def _latent_size(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    # prepare_latents and the tail of __call__: the VAE's compression, then an even size for the
    # 2x2 patches.
    return 2 * (int(height) // (vae_scale_factor * 2)), 2 * (int(width) // (vae_scale_factor * 2))


def _set_klein_timesteps(scheduler: Any, num_inference_steps: int, image_seq_len: int, device: Any) -> None:
    """Step 6 of ``__call__``: default sigmas ``linspace(1, 1/n, n)`` (none when the scheduler uses
    flow sigmas), ``mu = compute_empirical_mu(image_seq_len, n)``, then ``retrieve_timesteps``."""
    import numpy as np
    from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

    n = int(num_inference_steps)
    sigmas: Any = np.linspace(1.0, 1 / n, n)
    if getattr(scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    mu = compute_empirical_mu(image_seq_len=image_seq_len, num_steps=n)
    if sigmas is None:
        scheduler.set_timesteps(n, device=device, mu=mu)
    else:
        scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)


def _text_ids(prompt_embeds: torch.Tensor) -> torch.Tensor:
    """``_prepare_text_ids``: [B, L, 4] int64 coordinates (t, h, w, l) = (0, 0, 0, token index)."""
    import torch

    batch, length = prompt_embeds.shape[0], prompt_embeds.shape[1]
    zero = torch.arange(1)
    coords = torch.cartesian_prod(zero, zero, zero, torch.arange(length))
    return torch.stack([coords] * batch)


def _latent_ids(latents: torch.Tensor) -> torch.Tensor:
    """``_prepare_latent_ids``: [B, H*W, 4] int64 coordinates (0, row, column, 0) of [B, C, H, W]."""
    import torch

    batch, _, height, width = latents.shape
    zero = torch.arange(1)
    ids = torch.cartesian_prod(zero, torch.arange(height), torch.arange(width), zero)
    return ids.unsqueeze(0).expand(batch, -1, -1)


def _unpack_with_ids(x: torch.Tensor, ids: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``_unpack_latents_with_ids``: tokens [B, N, C] scattered to [B, C, height, width] at the
    (row, column) of their position ids."""
    import torch
    from diffusers.utils.torch_utils import maybe_adjust_dtype_for_device

    planes = []
    for tokens, pos in zip(x, ids, strict=True):
        channels = tokens.shape[1]
        index_dtype = maybe_adjust_dtype_for_device(torch.int64, tokens.device)
        flat = pos[:, 1].to(index_dtype) * width + pos[:, 2].to(index_dtype)
        out = torch.zeros((height * width, channels), device=tokens.device, dtype=tokens.dtype)
        out.scatter_(0, flat.unsqueeze(1).expand(-1, channels), tokens)
        planes.append(out.view(height, width, channels).permute(2, 0, 1))
    return torch.stack(planes, dim=0)


def _unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """``_unpatchify_latents``: [B, 4C, H, W] -> [B, C, 2H, 2W], each channel group a 2x2 patch."""
    b, c, h, w = latents.shape
    latents = latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3)
    return latents.reshape(b, c // 4, h * 2, w * 2)


def _load_vae(model_path: str, device: str, loader: Any) -> dict[str, Any]:
    """The VAE, its scale factor and ``Flux2KleinPipeline``'s image processor, as components."""
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor

    vae = load_component(_component_class(model_path, "vae"), model_path, "vae", device, loader)
    factor = vae_scale_factor(vae.config)
    return with_loads(
        {
            "vae": vae,
            "vae_scale_factor": factor,
            # Flux2KleinPipeline.__init__: the 2x2 patches double the effective scale factor
            "image_processor": Flux2ImageProcessor(vae_scale_factor=factor * 2),
        }
    )


def _load_flux2_lora(path: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A LoRA file as ``Flux2LoraLoaderMixin.load_lora_weights`` reads it, for :class:`LoraSwitch`."""
    from diffusers import Flux2KleinPipeline
    from diffusers.loaders.lora_pipeline import _LOW_CPU_MEM_USAGE_DEFAULT_LORA

    state_dict, metadata = Flux2KleinPipeline.lora_state_dict(path, return_lora_metadata=True)
    if not all("lora" in key or "lokr" in key for key in state_dict):
        raise ValueError(f"{path}: not a LoRA or LoKr adapter (a key without 'lora' or 'lokr')")
    # What load_lora_into_transformer passes load_lora_adapter (its prefix is the default).
    kwargs = dict(network_alphas=None, metadata=metadata, low_cpu_mem_usage=_LOW_CPU_MEM_USAGE_DEFAULT_LORA)
    return state_dict, "transformer", kwargs


# -- the ModelFns --------------------------------------------------------------------------------


class Flux2TextEncoder(ModelFn):
    """Qwen3 prompt encoding: ``prompt_embeds`` [B, max_sequence_length, 3 * hidden] and ``text_ids``
    [B, max_sequence_length, 4], B = 2 (prompt, the empty negative) when guiding, else 1."""

    fn_name = "flux2.text_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("guidance_scale")
        self.add_input("max_sequence_length")
        self.add_output("prompt_embeds")
        self.add_output("text_ids")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        import inspect

        from diffusers import Flux2KleinPipeline

        tokenizer = _component_class(model_path, "tokenizer").from_pretrained(
            model_path, subfolder="tokenizer"
        )
        text_encoder = load_component(
            _component_class(model_path, "text_encoder"), model_path, "text_encoder", device, loader
        )
        layers = inspect.signature(Flux2KleinPipeline.__call__).parameters["text_encoder_out_layers"].default
        return with_loads(
            {
                "tokenizer": tokenizer,
                "text_encoder": text_encoder,
                "out_layers": tuple(int(k) for k in layers),
                "is_distilled": _is_distilled(model_path),
            }
        )

    @staticmethod
    def _qwen3_prompt_embeds(
        components: dict[str, Any], prompt: str, max_sequence_length: int
    ) -> torch.Tensor:
        """``_get_qwen3_prompt_embeds`` for one prompt."""
        import torch

        tokenizer, text_encoder = components["tokenizer"], components["text_encoder"]
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=False,
        )
        tokens = tokenizer(
            text, return_tensors="pt", padding="max_length", truncation=True, max_length=max_sequence_length
        )
        device = text_encoder.device
        # The causal LM's decoder stack: the same hidden states, no logits (module docstring).
        output = text_encoder.model(
            input_ids=tokens["input_ids"].to(device),
            attention_mask=tokens["attention_mask"].to(device),
            output_hidden_states=True,
            use_cache=False,
        )
        stacked = torch.stack([output.hidden_states[k] for k in components["out_layers"]], dim=1)
        stacked = stacked.to(dtype=text_encoder.dtype, device=device)
        batch, layers, length, hidden = stacked.shape
        return stacked.permute(0, 2, 1, 3).reshape(batch, length, layers * hidden)

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        max_length = int(inputs["max_sequence_length"])
        if max_length < 1:
            raise ValueError(f"max_sequence_length must be at least 1, got {max_length}")
        with torch.no_grad():
            prompt_embeds = self._qwen3_prompt_embeds(components, str(inputs["prompt"]), max_length)
            if _do_cfg(inputs["guidance_scale"], components["is_distilled"]):
                # __call__ step 3: the negative prompt is always "", encoded on its own
                negative = self._qwen3_prompt_embeds(components, "", max_length)
                prompt_embeds = torch.cat([prompt_embeds, negative], dim=0)
            text_ids = _text_ids(prompt_embeds).to(prompt_embeds.device)
        return {"prompt_embeds": prompt_embeds, "text_ids": text_ids}


class Flux2PrepareLatents(ModelFn):
    """Initial noise and schedule: ``latents`` [1, h*w, 4C] (packed 2x2 patches; h, w the patch
    grid), ``latent_ids`` [1, h*w, 4] (int64) and ``timesteps`` [num_inference_steps] (fp32).
    Needs configs only, no weights."""

    fn_name = "flux2.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_output("latents")
        self.add_output("latent_ids")
        self.add_output("timesteps")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return {
            "num_channels_latents": int(_load_config(model_path, "transformer")["in_channels"]) // 4,
            "vae_scale_factor": vae_scale_factor(_load_config(model_path, "vae")),
            "scheduler_config": _load_config(model_path, "scheduler"),
            # prepare_latents draws in prompt_embeds.dtype: the text encoder's.
            "latents_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.utils.torch_utils import randn_tensor

        steps = int(inputs["num_inference_steps"])
        if steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1, got {steps}")
        height, width = _latent_size(inputs["height"], inputs["width"], components["vae_scale_factor"])
        if height < 2 or width < 2:
            raise ValueError(f"{inputs['height']}x{inputs['width']} is smaller than one latent patch")
        with torch.no_grad():
            # 5. prepare_latents: the generator's only draw, already patchified [1, 4C, h, w]
            shape = (1, components["num_channels_latents"] * 4, height // 2, width // 2)
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            noise = randn_tensor(
                shape, generator=generator, device=torch.device("cpu"), dtype=components["latents_dtype"]
            )
            latent_ids = _latent_ids(noise)
            latents = noise.reshape(shape[0], shape[1], shape[2] * shape[3]).permute(0, 2, 1)  # _pack_latents
            # 6. timesteps, on a scheduler of our own
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_klein_timesteps(scheduler, steps, latents.shape[1], device="cpu")
        return {"latents": latents, "latent_ids": latent_ids, "timesteps": scheduler.timesteps}


class Flux2Transformer(ModelFn):
    """One denoising step of ``Flux2Transformer2DModel`` with Klein's guidance: ``noise_pred``
    shaped like ``latents``. Optional ``lora`` (safetensors path, ``""`` = none) and
    ``lora_scale`` (default 1.0). Optional reference tokens ``image_latents`` [1, N, 4C] (packed)
    and their ``image_latent_ids`` [1, N, 4]: bound, they follow the noisy tokens
    (``torch.cat([latents, image_latents], dim=1)``, ids after ``latent_ids``) and each pass's
    prediction is cut back to the noisy tokens, as in the pipelines' loop body when they have
    ``image_latents`` (Klein's reference images, the inpainting picture); unbound, the step sees the
    noisy tokens alone."""

    fn_name = "flux2.transformer"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("prompt_embeds")
        self.add_input("text_ids")
        self.add_input("latent_ids")
        self.add_input("image_latents", optional=True)
        self.add_input("image_latent_ids", optional=True)
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_output("noise_pred")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        transformer = load_component(
            _component_class(model_path, "transformer"), model_path, "transformer", device, loader
        )
        return with_loads(
            {
                "transformer": transformer,
                "lora": LoraSwitch(transformer, _load_flux2_lora),
                "is_distilled": _is_distilled(model_path),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        transformer = components["transformer"]
        device = transformer.device
        lora_scale = inputs.get("lora_scale")
        components["lora"].use(inputs.get("lora") or None, 1.0 if lora_scale is None else float(lora_scale))
        guidance_scale = float(inputs["guidance_scale"])
        do_cfg = _do_cfg(guidance_scale, components["is_distilled"])
        prompt_embeds = inputs["prompt_embeds"].to(device)
        text_ids = inputs["text_ids"].to(device)
        if prompt_embeds.shape[0] != (2 if do_cfg else 1):
            raise ValueError(
                f"prompt_embeds has a batch of {prompt_embeds.shape[0]}; guidance_scale {guidance_scale} "
                f"needs {2 if do_cfg else 1} (flux2.text_encoder with the same guidance_scale)"
            )
        latents = inputs["latents"].to(device)
        latent_ids = inputs["latent_ids"].to(device)
        image_latents, image_latent_ids = inputs.get("image_latents"), inputs.get("image_latent_ids")
        if (image_latents is None) != (image_latent_ids is None):
            raise ValueError("image_latents and image_latent_ids are bound together or not at all")
        with torch.no_grad():
            # 7. Denoising loop body
            t = inputs["timesteps"].to(device)[int(inputs["step"])]
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            latent_model_input = latents.to(transformer.dtype)
            if image_latents is not None:
                # the reference tokens after the noisy ones, their ids after the latents'
                latent_model_input = torch.cat([latents, image_latents.to(device)], dim=1).to(
                    transformer.dtype
                )
                latent_ids = torch.cat([latent_ids, image_latent_ids.to(device)], dim=1)

            def predict(row: int, context: str) -> torch.Tensor:
                with transformer.cache_context(context):
                    out = transformer(
                        hidden_states=latent_model_input,
                        timestep=timestep / 1000,
                        guidance=None,
                        encoder_hidden_states=prompt_embeds[row : row + 1],
                        txt_ids=text_ids[row : row + 1],
                        img_ids=latent_ids,
                        joint_attention_kwargs=None,
                        return_dict=False,
                    )[0]
                return out[:, : latents.size(1) :]

            noise_pred = predict(0, "cond")
            if do_cfg:
                neg_noise_pred = predict(1, "uncond")
                noise_pred = neg_noise_pred + guidance_scale * (noise_pred - neg_noise_pred)
        return {"noise_pred": noise_pred}


class Flux2SchedulerStep(ModelFn):
    """One flow-matching Euler step, stateless: ``latents`` of step ``step + 1``."""

    fn_name = "flux2.scheduler_step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return {"scheduler_config": _load_config(model_path, "scheduler")}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        latents = inputs["latents"]
        noise_pred = inputs["noise_pred"].to(latents.device)
        step, steps = int(inputs["step"]), int(inputs["num_inference_steps"])
        with torch.no_grad():
            # A fresh scheduler in the state the pipeline's is in at iteration `step`.
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_klein_timesteps(scheduler, steps, latents.shape[1], device=latents.device)
            timesteps = inputs["timesteps"].to(latents.device)
            if not torch.equal(scheduler.timesteps, timesteps):
                raise ValueError(
                    f"timesteps do not match a {steps}-step schedule for {latents.shape[1]} latent tokens"
                )
            if not 0 <= step < len(timesteps):
                raise ValueError(f"step {step} is outside the {len(timesteps)}-step schedule")
            scheduler.set_begin_index(step)
            # compute the previous noisy sample x_t -> x_t-1
            latents = scheduler.step(noise_pred, timesteps[step], latents, return_dict=False)[0]
        return {"latents": latents}


class Flux2VaeDecode(ModelFn):
    """Latents to pixels (``AutoencoderKLFlux2``): ``image``, a uint8 [H, W, 3] tensor equal to
    ``np.array`` of the pipeline's PIL image."""

    fn_name = "flux2.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("latent_ids")
        self.add_input("height")
        self.add_input("width")
        self.add_output("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return _load_vae(model_path, device, loader)

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae = components["vae"]
        height, width = _latent_size(inputs["height"], inputs["width"], components["vae_scale_factor"])
        with torch.no_grad():
            # the tail of __call__
            latents = _unpack_with_ids(inputs["latents"], inputs["latent_ids"], height // 2, width // 2)
            bn = vae.bn
            mean = bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
            std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(
                latents.device, latents.dtype
            )
            latents = _unpatchify(latents * std + mean)
            image = vae.decode(latents.to(vae.device), return_dict=False)[0]
            return {"image": to_uint8_image(components["image_processor"], image)}
