"""The Flux model family as ModelFns: diffusers' Flux pipelines cut at their seams.

Each class below mirrors one stretch of ``diffusers/pipelines/flux/pipeline_flux.py`` (diffusers
0.42.1) and runs it on its own, so a workflow of these nodes reproduces the monolithic pipeline's image
bitwise (measured by the family's tests, on the CPU with the thread count pinned). Dev and schnell
checkpoints use the same classes: the transformer adds guidance only when ``config.guidance_embeds``;
schnell's scheduler (no dynamic shifting) goes through the same ``set_timesteps`` call, which then
ignores ``mu``. The ControlNet-only nodes of ``pipeline_flux_controlnet.py`` (``flux.control_encoder``,
``flux.controlnet``) live in :mod:`libs.models.flux_controlnet`; the nodes here serve that pipeline too,
through their optional inputs.

==========================  =====================================================================
ModelFn (``fn_name``)       what it mirrors
==========================  =====================================================================
``flux.clip_encoder``       ``_get_clip_prompt_embeds``: CLIP tokenizer + ``pooler_output``
``flux.t5_encoder``         ``_get_t5_prompt_embeds`` + the ``text_ids`` line of ``encode_prompt``
``flux.prepare_latents``    step 4 ``prepare_latents`` (noise, 2x2 packing, ``latent_image_ids``)
                            and step 5 ``calculate_shift`` + ``retrieve_timesteps``
``flux.transformer``        one iteration of the loop up to ``noise_pred`` (guidance, t/1000),
                            with optional ControlNet residuals (fetched mid-forward) and LoRA
``flux.true_cfg``           ``noise_pred = neg + true_cfg_scale * (noise_pred - neg)``
``flux.flow_match_step``    the ``self.scheduler.step(noise_pred, t, latents)`` line of that loop
``flux.vae_decode``         the tail: ``_unpack_latents``, scale/shift, ``vae.decode``, postprocess
==========================  =====================================================================

The denoising loop itself is the workflow's: for ``step`` in ``range(num_inference_steps)`` it binds
``flux.transformer`` then ``flux.flow_match_step``. Batch size is 1 and ``num_images_per_prompt`` is
1 (the platform never batches requests: batching changes the bits). IP-Adapter and callbacks are not
mirrored.

ControlNet inputs (the paper, §5.2). ``flux.transformer`` declares the two residual lists of
``flux.controlnet`` as optional *callback* inputs: it starts its forward at once and fetches
``controlnet_block_samples`` when the first double block has run (``FluxTransformer2DModel.forward``
first reads them after block 0) and the single ones after the first single block, through
:func:`~libs.models.common.lazy_list`. Left unbound, they are ``None`` and the same class serves the
basic workflow. ``flux.prepare_latents`` continues from the request generator's state after
``flux.control_encoder``'s draw when its optional ``generator_state`` input is bound, instead of
seeding a fresh generator (the generator trap, :mod:`libs.models.flux_controlnet`).

LoRA. ``flux.transformer`` takes optional ``lora`` (a safetensors path, ``""``/unbound = none) and
``lora_scale`` inputs. A :class:`~libs.models.lora.LoraSwitch` keeps adapters loaded as separate PEFT
layers and switches per call (``set_adapters`` / ``disable_lora``), never fusing; adapters load the
way ``FluxLoraLoaderMixin.load_lora_weights`` loads them into the transformer (``lora_state_dict``
with network alphas and adapter metadata, prefix ``transformer``). Text-encoder LoRA weights are
refused: the text-encoder nodes do not apply them, so the image would silently differ.

True CFG (the paper, Fig. 12-right). ``FluxPipeline`` with ``negative_prompt`` and ``true_cfg_scale > 1``
runs the transformer twice per step, unbatched, and combines. A workflow runs two ``flux.transformer``
nodes per step (positive and negative embeddings; they may run on two executors) and the light
``flux.true_cfg`` node. (The pipeline's ``cache_context("uncond")`` only matters with caching hooks,
enabled here only on the basic workflow's single pass: the cfg-parallel workflow offers no caching.)

Why the scheduler step is stateless. ``FlowMatchEulerDiscreteScheduler`` keeps ``sigmas`` and a
``_step_index`` between calls, but consecutive steps of one request may run on different executors
(or after a retry). The Euler step is ``x + (sigma[i+1] - sigma[i]) * v`` in fp32, and the sigmas are
a pure function of ``(num_inference_steps, mu)``, with ``mu`` a function of the packed sequence length
``latents.shape[1]``. So the node carries only ``(num_inference_steps, step)``, rebuilds a fresh
scheduler per call with the pipeline's exact ``set_timesteps`` arguments, and pins the index with
``set_begin_index(step)``: bitwise equal to the pipeline's stateful scheduler.

Dtypes follow the pipeline as loaded by ``from_pretrained`` without ``torch_dtype``: transformers
models load at the dtype saved in their config, diffusers models at fp32. Two values depend on a
component another node owns, so they are read from that component's config, not its weights:
``text_ids`` takes the *CLIP* encoder's dtype (``encode_prompt``: ``self.text_encoder.dtype``), and
the noise takes the *T5* embeddings' dtype (``prepare_latents(..., prompt_embeds.dtype, ...)``).

This module imports no torch, diffusers or transformers at import time: the registry reads
``signature()`` of these classes in a process without torch. Heavy imports live in the methods.
``load_model`` puts the models on the device it is given; ``flux.prepare_latents`` always runs on
the CPU, as the pipeline's CPU generator draws the noise there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from libs.models.common import (
    calculate_shift,
    config_dtype,
    lazy_list,
    load_component,
    run_dtype,
    to_uint8_image,
    vae_scale_factor,
    with_loads,
)
from libs.models.lora import LoraSwitch
from libs.models.stepcache import step_cache
from libs.workflow.modelfn import ModelFn

if TYPE_CHECKING:
    import torch


# -- helpers mirroring FluxPipeline's module functions and static methods --------------------------


def _latent_size(height: int, width: int, vae_scale_factor: int) -> tuple[int, int]:
    # prepare_latents/_unpack_latents: the VAE compresses by vae_scale_factor and packing needs
    # an even latent height and width.
    return 2 * (int(height) // (vae_scale_factor * 2)), 2 * (int(width) // (vae_scale_factor * 2))


def _set_flux_timesteps(scheduler: Any, num_inference_steps: int, image_seq_len: int, device: Any) -> None:
    """FluxPipeline step 5: default sigmas ``linspace(1, 1/n, n)`` (dropped when the scheduler uses
    flow sigmas), ``mu`` from the packed sequence length, then ``retrieve_timesteps``'s sigmas branch,
    i.e. ``set_timesteps(sigmas=..., device=..., mu=...)``."""
    import numpy as np

    n = int(num_inference_steps)
    sigmas: Any = np.linspace(1.0, 1 / n, n)
    if getattr(scheduler.config, "use_flow_sigmas", False):
        sigmas = None
    config = scheduler.config
    mu = calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    if sigmas is None:
        scheduler.set_timesteps(n, device=device, mu=mu)
    else:
        scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)


def _pack_latents(latents: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, (H/2)*(W/2), 4C]: every 2x2 latent patch becomes one token."""
    b, c = latents.shape[0], latents.shape[1]
    latents = latents.view(b, c, height // 2, 2, width // 2, 2)
    latents = latents.permute(0, 2, 4, 1, 3, 5)
    return latents.reshape(b, (height // 2) * (width // 2), c * 4)


def _unpack_latents(latents: torch.Tensor, height: int, width: int, vae_scale_factor: int) -> torch.Tensor:
    """Inverse of :func:`_pack_latents`, from the image size in pixels."""
    b, _, channels = latents.shape
    lh, lw = _latent_size(height, width, vae_scale_factor)
    latents = latents.view(b, lh // 2, lw // 2, channels // 4, 2, 2)
    latents = latents.permute(0, 3, 1, 4, 2, 5)
    return latents.reshape(b, channels // 4, lh, lw)


def _latent_image_ids(height: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """[h*w, 3] position ids of the packed tokens: (0, row, column), for the 3-axis RoPE."""
    import torch

    ids = torch.zeros(height, width, 3)
    ids[..., 1] = ids[..., 1] + torch.arange(height)[:, None]
    ids[..., 2] = ids[..., 2] + torch.arange(width)[None, :]
    return ids.reshape(height * width, 3).to(dtype=dtype)


# -- the ModelFns --------------------------------------------------------------------------------


class FluxClipEncoder(ModelFn):
    """CLIP text encoder: the pooled prompt embedding, ``pooled_prompt_embeds`` [1, hidden]."""

    fn_name = "flux.clip_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_output("pooled_prompt_embeds")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from transformers import CLIPTextModel, CLIPTokenizer

        tokenizer = CLIPTokenizer.from_pretrained(model_path, subfolder="tokenizer")
        text_encoder = load_component(CLIPTextModel, model_path, "text_encoder", device, loader)
        return with_loads({"tokenizer": tokenizer, "text_encoder": text_encoder})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        prompt: str = inputs["prompt"]
        tokenizer, text_encoder = components["tokenizer"], components["text_encoder"]
        with torch.no_grad():
            # _get_clip_prompt_embeds (maybe_convert_prompt is the identity: no textual inversion).
            text_input_ids = tokenizer(
                [prompt],
                padding="max_length",
                max_length=tokenizer.model_max_length,
                truncation=True,
                return_overflowing_tokens=False,
                return_length=False,
                return_tensors="pt",
            ).input_ids
            out = text_encoder(text_input_ids.to(text_encoder.device), output_hidden_states=False)
            # Use pooled output of CLIPTextModel
            pooled_prompt_embeds = out.pooler_output.to(dtype=text_encoder.dtype)
        return {"pooled_prompt_embeds": pooled_prompt_embeds}


class FluxT5Encoder(ModelFn):
    """T5 text encoder: ``prompt_embeds`` [1, max_sequence_length, d_model] and ``text_ids``
    [max_sequence_length, 3] zeros."""

    fn_name = "flux.t5_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("max_sequence_length")
        self.add_output("prompt_embeds")
        self.add_output("text_ids")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from transformers import T5EncoderModel, T5TokenizerFast

        tokenizer_2 = T5TokenizerFast.from_pretrained(model_path, subfolder="tokenizer_2")
        text_encoder_2 = load_component(T5EncoderModel, model_path, "text_encoder_2", device, loader)
        return with_loads(
            {
                "tokenizer_2": tokenizer_2,
                "text_encoder_2": text_encoder_2,
                # encode_prompt builds text_ids in the CLIP encoder's dtype, not T5's.
                "text_ids_dtype": config_dtype(model_path, "text_encoder", run_dtype(loader)),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        prompt: str = inputs["prompt"]
        max_sequence_length = int(inputs["max_sequence_length"])
        if max_sequence_length > 512:  # FluxPipeline.check_inputs
            raise ValueError(f"max_sequence_length cannot be greater than 512 but is {max_sequence_length}")
        tokenizer_2, text_encoder_2 = components["tokenizer_2"], components["text_encoder_2"]
        with torch.no_grad():
            # _get_t5_prompt_embeds
            text_input_ids = tokenizer_2(
                [prompt],
                padding="max_length",
                max_length=max_sequence_length,
                truncation=True,
                return_length=False,
                return_overflowing_tokens=False,
                return_tensors="pt",
            ).input_ids
            out = text_encoder_2(text_input_ids.to(text_encoder_2.device), output_hidden_states=False)[0]
            prompt_embeds = out.to(dtype=text_encoder_2.dtype)
            # encode_prompt: text_ids = zeros(seq_len, 3) in text_encoder.dtype
            text_ids = torch.zeros(prompt_embeds.shape[1], 3).to(
                device=prompt_embeds.device, dtype=components["text_ids_dtype"]
            )
        return {"prompt_embeds": prompt_embeds, "text_ids": text_ids}


class FluxPrepareLatents(ModelFn):
    """Initial noise and schedule: ``latents`` [1, seq, 4C] (packed), ``latent_image_ids`` [seq, 3]
    and ``timesteps`` [num_inference_steps] (fp32). Needs configs only, no weights.

    ``generator_state`` (optional): the request generator's state after ``flux.control_encoder``
    drew from it; when bound, the noise continues from it (the ControlNet pipeline's draw order)
    instead of from a generator freshly seeded with ``seed``."""

    fn_name = "flux.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_input("generator_state", optional=True)
        self.add_output("latents")
        self.add_output("latent_image_ids")
        self.add_output("timesteps")
        self.add_output("cache_state")  # the first step's step-cache state: none (libs.models.stepcache)

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxTransformer2DModel

        transformer_config = FluxTransformer2DModel.load_config(model_path, subfolder="transformer")
        vae_config = AutoencoderKL.load_config(model_path, subfolder="vae")
        return {
            "num_channels_latents": int(transformer_config["in_channels"]) // 4,
            "vae_scale_factor": vae_scale_factor(vae_config),
            "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(
                model_path, subfolder="scheduler"
            ),
            # prepare_latents draws the noise in prompt_embeds.dtype, i.e. T5's.
            "latents_dtype": config_dtype(model_path, "text_encoder_2", run_dtype(loader)),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        seed, steps = int(inputs["seed"]), int(inputs["num_inference_steps"])
        height, width = _latent_size(inputs["height"], inputs["width"], components["vae_scale_factor"])
        channels, dtype = components["num_channels_latents"], components["latents_dtype"]
        with torch.no_grad():
            # 4. prepare_latents: randn_tensor with the request's CPU generator samples on the CPU.
            # FluxPipeline: the generator's first draw. FluxControlNetPipeline: its draw after the
            # control image's VAE sample (FluxControlNetPipeline.__call__ samples the control latents
            # with retrieve_latents(..., generator) in step 3, then prepare_latents in step 4), so we
            # continue from the state after that draw.
            generator = torch.Generator(device="cpu")
            state = inputs.get("generator_state")
            if state is None:
                generator.manual_seed(seed)
            else:
                generator.set_state(state.to(device="cpu", dtype=torch.uint8).contiguous())
            noise = torch.randn((1, channels, height, width), generator=generator, device="cpu", dtype=dtype)
            latents = _pack_latents(noise, height, width)
            latent_image_ids = _latent_image_ids(height // 2, width // 2, dtype)
            # 5. timesteps, on a scheduler of our own (the stateful one is never shared).
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_flux_timesteps(scheduler, steps, latents.shape[1], device="cpu")
            timesteps = scheduler.timesteps
        return {
            "latents": latents,
            "latent_image_ids": latent_image_ids,
            "timesteps": timesteps,
            "cache_state": [],
        }


def _control_residuals(value: Any, name: str, device: Any) -> Any:
    """A ControlNet residual input as the transformer's forward wants it: None when unbound, else
    a lazy list that fetches (a Deferred is callable) at the forward's first use."""

    def pick(samples: Any) -> list[Any]:
        if not samples:
            # FluxTransformer2DModel.forward divides by len(samples): an empty list cannot stand
            # for "no residuals" once the forward has started.
            raise ValueError(f"{name} is empty: the ControlNet has no blocks of that kind")
        return [sample.to(device) for sample in samples]

    return lazy_list(value, pick)


def _load_flux_lora(path: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A LoRA file as ``FluxLoraLoaderMixin.load_lora_weights`` reads it, for :class:`LoraSwitch`."""
    from diffusers import FluxPipeline

    # FluxLoraLoaderMixin.load_lora_weights: the state dict (kohya/xlabs/... converted to
    # diffusers keys), its network alphas and the adapter metadata stored in the file.
    state_dict, network_alphas, metadata = FluxPipeline.lora_state_dict(
        path, return_alphas=True, return_lora_metadata=True
    )
    foreign = sorted(k for k in state_dict if not (k.startswith("transformer.") and "lora" in k))
    if foreign:
        raise ValueError(
            f"{path}: only transformer LoRA weights are supported; found {len(foreign)} other keys, "
            f"e.g. {foreign[0]!r}"
        )
    # What FluxLoraLoaderMixin.load_lora_into_transformer passes load_lora_adapter;
    # low_cpu_mem_usage is load_lora_weights' default with peft and transformers > 4.45.2 (it only
    # avoids a random init of the LoRA layers before the file's weights replace it).
    return (
        state_dict,
        "transformer",
        dict(network_alphas=network_alphas, metadata=metadata, low_cpu_mem_usage=True),
    )


class FluxTransformer(ModelFn):
    """One denoising step of the Flux transformer: ``noise_pred`` shaped like ``latents``.

    Optional inputs: ``controlnet_block_samples`` / ``controlnet_single_block_samples`` (callback:
    fetched inside the forward), ``lora`` (safetensors path, ``""`` = none) and ``lora_scale``
    (default 1.0)."""

    fn_name = "flux.transformer"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("prompt_embeds")
        self.add_input("pooled_prompt_embeds")
        self.add_input("text_ids")
        self.add_input("latent_image_ids")
        self.add_input("controlnet_block_samples", callback=True, optional=True)
        self.add_input("controlnet_single_block_samples", callback=True, optional=True)
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_input("cache", optional=True)
        self.add_input("cache_threshold", optional=True)
        self.add_input("cache_state", optional=True)
        self.add_output("noise_pred")
        self.add_output("cache_state")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FluxTransformer2DModel

        transformer = load_component(FluxTransformer2DModel, model_path, "transformer", device, loader)
        return with_loads({"transformer": transformer, "lora": LoraSwitch(transformer, _load_flux_lora)})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        transformer = components["transformer"]
        device = transformer.device
        latents = inputs["latents"].to(device)
        # The request's adapter (or none), as pipe.set_adapters([name], [lora_scale]) would set it.
        lora_scale = inputs.get("lora_scale")
        components["lora"].use(inputs.get("lora") or None, 1.0 if lora_scale is None else float(lora_scale))
        block_samples = _control_residuals(
            inputs.get("controlnet_block_samples"), "controlnet_block_samples", device
        )
        single_block_samples = _control_residuals(
            inputs.get("controlnet_single_block_samples"), "controlnet_single_block_samples", device
        )
        with torch.no_grad():
            # handle guidance (before the loop in the pipeline; a pure function of guidance_scale).
            # FluxControlNetPipeline builds it as torch.tensor([guidance_scale]): the same fp32 value.
            guidance = None
            if transformer.config.guidance_embeds:
                guidance = torch.full(
                    [1], float(inputs["guidance_scale"]), device=device, dtype=torch.float32
                )
                guidance = guidance.expand(latents.shape[0])
            # 6. Denoising loop body: t = timesteps[i]; broadcast to the batch dimension.
            t = inputs["timesteps"].to(device)[int(inputs["step"])]
            timestep = t.expand(latents.shape[0]).to(latents.dtype)
            kwargs: dict[str, Any] = {}
            if block_samples is not None or single_block_samples is not None:
                # FluxControlNetPipeline.__call__: residuals of a ControlNet without an
                # input_hint_block, so controlnet_blocks_repeat=False.
                kwargs = dict(
                    controlnet_block_samples=block_samples,
                    controlnet_single_block_samples=single_block_samples,
                    controlnet_blocks_repeat=False,
                )
            out: dict[str, Any] = {}
            with step_cache(transformer, inputs, out), transformer.cache_context("cond"):
                out["noise_pred"] = transformer(
                    hidden_states=latents,
                    timestep=timestep / 1000,
                    guidance=guidance,
                    pooled_projections=inputs["pooled_prompt_embeds"].to(device),
                    encoder_hidden_states=inputs["prompt_embeds"].to(device),
                    txt_ids=inputs["text_ids"].to(device),
                    img_ids=inputs["latent_image_ids"].to(device),
                    joint_attention_kwargs={},
                    return_dict=False,
                    **kwargs,
                )[0]
        return out


class FluxTrueCfg(ModelFn):
    """True classifier-free guidance: ``noise_pred`` from the positive and negative predictions of
    one step, ``neg + true_cfg_scale * (pos - neg)`` (``FluxPipeline`` with ``negative_prompt``).
    With ``true_cfg_scale <= 1`` the pipeline skips the negative pass (``do_true_cfg`` is false),
    so the positive prediction passes through unchanged."""

    fn_name = "flux.true_cfg"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("neg_noise_pred")
        self.add_input("true_cfg_scale")
        self.add_output("noise_pred")

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        noise_pred = inputs["noise_pred"]
        true_cfg_scale = float(inputs["true_cfg_scale"])
        if not true_cfg_scale > 1:
            return {"noise_pred": noise_pred}
        with torch.no_grad():
            neg_noise_pred = inputs["neg_noise_pred"].to(noise_pred.device)
            # FluxPipeline.__call__'s true-CFG combination, same operations in the same order.
            noise_pred = neg_noise_pred + true_cfg_scale * (noise_pred - neg_noise_pred)
        return {"noise_pred": noise_pred}


class FlowMatchEulerStep(ModelFn):
    """One flow-matching Euler step, stateless: ``latents`` of step ``step + 1``."""

    fn_name = "flux.flow_match_step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import FlowMatchEulerDiscreteScheduler

        return {
            "scheduler_config": FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler")
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        latents, noise_pred = inputs["latents"], inputs["noise_pred"]
        noise_pred = noise_pred.to(latents.device)
        step, steps = int(inputs["step"]), int(inputs["num_inference_steps"])
        with torch.no_grad():
            # A fresh scheduler in the state the pipeline's is in at iteration `step` (module docstring).
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_flux_timesteps(scheduler, steps, latents.shape[1], device=latents.device)
            timesteps = inputs["timesteps"].to(latents.device)
            if not torch.equal(scheduler.timesteps, timesteps):
                raise ValueError(
                    f"timesteps do not match a {steps}-step schedule for {latents.shape[1]} latent tokens"
                )
            scheduler.set_begin_index(step)
            # compute the previous noisy sample x_t -> x_t-1
            latents = scheduler.step(noise_pred, timesteps[step], latents, return_dict=False)[0]
        return {"latents": latents}


class FluxVaeDecode(ModelFn):
    """Latents to pixels: ``image``, a uint8 [H, W, 3] tensor equal to ``np.array`` of the
    pipeline's PIL image."""

    fn_name = "flux.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("height")
        self.add_input("width")
        self.add_output("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        factor = vae_scale_factor(vae.config)
        return with_loads(
            {
                "vae": vae,
                "vae_scale_factor": factor,
                # FluxPipeline.__init__: packing doubles the effective scale factor
                "image_processor": VaeImageProcessor(vae_scale_factor=factor * 2),
            }
        )

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        height, width = int(inputs["height"]), int(inputs["width"])
        with torch.no_grad():
            latents = _unpack_latents(inputs["latents"], height, width, components["vae_scale_factor"])
            latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
            image = vae.decode(latents.to(vae.device), return_dict=False)[0]
            return {"image": to_uint8_image(image_processor, image)}
