"""The Z-Image model family as five ModelFns: diffusers' ``ZImagePipeline.__call__`` cut at its seams.

Each class mirrors one stretch of ``diffusers/pipelines/z_image/pipeline_z_image.py`` (diffusers
0.42.1) and runs it on its own, so a workflow of these nodes reproduces the monolithic pipeline's
image bitwise (the family's tests, on the CPU with one thread). Base Z-Image and the distilled
Z-Image-Turbo are the same pipeline with other defaults (steps, guidance) and another scheduler
config, so the same classes serve both. The ControlNet-only nodes of
``pipeline_z_image_controlnet.py`` (``zimage.control_encode``, ``zimage.controlnet``) live in
:mod:`libs.models.zimage_controlnet`; the nodes here serve that pipeline too, through their
optional inputs.

============================  ===================================================================
ModelFn (``fn_name``)         what it mirrors
============================  ===================================================================
``zimage.text_encoder``       ``encode_prompt`` / ``_encode_prompt``: the chat template, the
                              tokenizer, the Qwen3 encoder's second-to-last hidden state, the
                              padding dropped; the negative prompt iff guidance is on
``zimage.prepare_latents``    ``__call__``'s size check, step 4 ``prepare_latents`` and step 5
                              (``calculate_shift``, ``get_default_z_image_sigmas``,
                              ``retrieve_timesteps``)
``zimage.transformer``        the loop body up to ``noise_pred``: ``(1000 - t) / 1000``, CFG
                              truncation, the batched CFG pass, the guidance combine with its
                              optional renormalisation, ``squeeze(2)`` and the sign flip; with
                              optional ControlNet block samples (fetched mid-forward) and LoRA
``zimage.scheduler_step``     the loop's ``self.scheduler.step(noise_pred, t, latents)``, stateless
``zimage.vae_decode``         the tail: ``latents / scaling_factor + shift_factor``, ``vae.decode``,
                              postprocess
============================  ===================================================================

The denoising loop is the workflow's. Batch size and ``num_images_per_prompt`` are 1 (the platform
never batches requests: batching changes the bits); user-supplied embeddings/latents, custom
``sigmas`` and step callbacks are not mirrored.

What travels between the nodes (so other workflows, e.g. image-to-image, can reuse them):

* ``prompt_embeds`` / ``negative_prompt_embeds``: 2-D ``[tokens, hidden]`` tensors, one per prompt,
  of the prompt's own length (the pipeline's lists of unpadded embeddings; the negative one is
  ``[0, hidden]`` when guidance is off, as the pipeline then encodes no negative prompt).
* ``latents``: ``[1, C, H/8, W/8]`` fp32 (unpacked; the transformer patchifies them itself).
* ``timesteps``: the 1-D fp32 schedule the loop runs, ``scheduler.timesteps``. The scheduler step
  accepts the tail of the full ``num_inference_steps`` schedule too (an image-to-image pipeline's
  ``get_timesteps``) and pins its index past the skipped steps.
* ``noise_pred``: what the pipeline hands ``scheduler.step``: the guided transformer output with
  its sign flipped, ``[1, C, H/8, W/8]`` fp32.

Guidance, as the pipeline decides it. ``do_classifier_free_guidance`` is ``guidance_scale > 0``
(not ``> 1``) and the combine is ``pos + guidance_scale * (pos - neg)``. ``cfg_truncation``
(default 1.0) turns guidance off for the steps whose normalised time ``(1000 - t) / 1000``
exceeds it; ``cfg_normalization`` (a float, 0 = off; the pipeline's ``False``) caps the guided
prediction's norm at that multiple of the positive one's.

Stateless scheduler step. Consecutive steps of one request may run on different executors, so
``zimage.scheduler_step`` rebuilds a ``FlowMatchEulerDiscreteScheduler`` per call from the saved
config with the pipeline's ``set_timesteps(sigmas=get_default_z_image_sigmas(n), mu=...)`` (``mu``
from the latents' shape; a scheduler without dynamic shifting ignores it), checks the carried
``timesteps`` against that schedule and pins ``set_begin_index``. The Euler step has no other
state; ``stochastic_sampling`` (which draws noise inside ``step``) is refused.

LoRA. ``zimage.transformer`` takes ``lora`` (a safetensors path, "" = none) and ``lora_scale`` and
switches adapters with :class:`~libs.models.lora.LoraSwitch` (never fused), the adapter read as
``ZImageLoraLoaderMixin.load_lora_weights`` reads it (``lora_state_dict`` with its metadata, no
network alphas) and weighted as ``set_adapters([name], [lora_scale])`` weighs it.

Dtypes follow the pipeline as loaded by ``from_pretrained`` without ``torch_dtype``. Noise is drawn
in fp32 on the CPU from ``torch.Generator("cpu").manual_seed(seed)`` (its only draw), as
``prepare_latents(..., torch.float32, ...)`` with a CPU generator does on any device.

No torch, diffusers or transformers at import time: the registry reads ``signature()`` without
them. ``load_model`` puts the models on the device it is given.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.models.common import calculate_shift, load_component, to_uint8_image, vae_scale_factor, with_loads
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


def _scheduler_config(model_path: str) -> dict[str, Any]:
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = dict(FlowMatchEulerDiscreteScheduler.load_config(model_path, subfolder="scheduler"))
    if config.get("stochastic_sampling", False):
        raise ValueError("zimage.scheduler_step: stochastic_sampling draws from the generator; not supported")
    return config


def _vae_scale(model_path: str) -> int:
    """``vae_scale_factor * 2`` of ``ZImagePipeline.__init__``: what height and width must divide by."""
    from diffusers import AutoencoderKL

    return vae_scale_factor(AutoencoderKL.load_config(model_path, subfolder="vae")) * 2


def _set_timesteps(scheduler: Any, num_inference_steps: int, latents_shape: Any, device: Any) -> None:
    """Step 5 of ``__call__``: the shift ``mu`` from the latents' patch count, the default sigmas
    and ``retrieve_timesteps(scheduler, n, device, sigmas=..., mu=mu)``."""
    import torch

    config = scheduler.config
    image_seq_len = (int(latents_shape[2]) // 2) * (int(latents_shape[3]) // 2)
    mu = calculate_shift(
        image_seq_len,
        config.get("base_image_seq_len", 256),
        config.get("max_image_seq_len", 4096),
        config.get("base_shift", 0.5),
        config.get("max_shift", 1.15),
    )
    # get_default_z_image_sigmas
    sigmas = torch.linspace(1.0, 1 / num_inference_steps, num_inference_steps).tolist()
    scheduler.set_timesteps(sigmas=sigmas, device=device, mu=mu)


def _do_cfg(guidance_scale: float) -> bool:
    # ZImagePipeline.do_classifier_free_guidance
    return float(guidance_scale) > 0


def guided_inputs(
    inputs: dict[str, Any], device: Any, dtype: Any
) -> tuple[float, bool, list[Any], Any, list[Any]]:
    """The loop body's inputs of one step, for the transformer and the ControlNet alike:
    (``current_guidance_scale``, ``apply_cfg``, the latents as the model's list of [C, 1, h, w],
    ``timestep_model_input``, ``prompt_embeds_model_input``), from the node inputs ``latents``,
    ``timesteps``, ``step``, ``guidance_scale``, ``cfg_truncation``, ``prompt_embeds`` and
    ``negative_prompt_embeds``."""
    guidance_scale, step = float(inputs["guidance_scale"]), int(inputs["step"])
    cfg_truncation = inputs["cfg_truncation"]
    latents = inputs["latents"].to(device)
    timesteps = inputs["timesteps"].to(device)
    do_cfg = _do_cfg(guidance_scale)
    t = timesteps[step]
    # broadcast to the batch dimension, then the model's time: 0 at the start, 1 at the end
    timestep = t.expand(latents.shape[0])
    timestep = (1000 - timestep) / 1000
    current_guidance_scale = guidance_scale
    if do_cfg and cfg_truncation is not None and float(cfg_truncation) <= 1:
        t_norm = ((1000 - timesteps.float()) / 1000)[step].item()  # _precomputed_t_norms[i]
        if t_norm > float(cfg_truncation):
            current_guidance_scale = 0.0
    apply_cfg = do_cfg and current_guidance_scale > 0
    prompt_embeds = [inputs["prompt_embeds"].to(device)]
    if apply_cfg:
        latent_model_input = latents.to(dtype).repeat(2, 1, 1, 1)
        prompt_embeds_model_input = prompt_embeds + [inputs["negative_prompt_embeds"].to(device)]
        timestep_model_input = timestep.repeat(2)
    else:
        latent_model_input = latents.to(dtype)
        prompt_embeds_model_input = prompt_embeds
        timestep_model_input = timestep
    latent_model_input = latent_model_input.unsqueeze(2)
    return (
        current_guidance_scale,
        apply_cfg,
        list(latent_model_input.unbind(dim=0)),
        timestep_model_input,
        prompt_embeds_model_input,
    )


class LazyBlockSamples(Mapping):
    """``controlnet_block_samples`` as ``ZImageTransformer2DModel.forward`` reads it (``i in
    samples`` after main layer ``i``, then ``samples[i]``): the ControlNet's block samples keyed by
    its layer places, both callback inputs fetched at the first look-up (the places first)."""

    def __init__(self, samples: Any, places: Any, device: Any, dtype: Any) -> None:
        self._fetch_samples = samples if callable(samples) else (lambda: samples)
        self._fetch_places = places if callable(places) else (lambda: places)
        self._device, self._dtype = device, dtype
        self._items: dict[int, Any] | None = None

    def _get(self) -> dict[int, Any]:
        if self._items is None:
            places = [int(p) for p in self._fetch_places()]
            samples = list(self._fetch_samples())
            if len(places) != len(samples):
                raise ValueError(f"{len(samples)} ControlNet block samples for {len(places)} layer places")
            self._items = {
                p: s.to(device=self._device, dtype=self._dtype) for p, s in zip(places, samples, strict=True)
            }
        return self._items

    @property
    def fetched(self) -> bool:
        return self._items is not None

    def __getitem__(self, key: int) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[int]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _load_zimage_lora(path: str) -> tuple[dict[str, Any], str, dict[str, Any]]:
    """A LoRA file as ``ZImageLoraLoaderMixin.load_lora_weights`` reads it, for :class:`LoraSwitch`."""
    from diffusers import ZImagePipeline

    state_dict, metadata = ZImagePipeline.lora_state_dict(path, return_lora_metadata=True)
    if not all("lora" in key or "lokr" in key for key in state_dict):
        raise ValueError("Invalid adapter checkpoint. We currently support LoRA and LoKr.")
    foreign = sorted(k for k in state_dict if not k.startswith("transformer."))
    if foreign:
        raise ValueError(
            f"{path}: only transformer LoRA weights are supported; found {len(foreign)} other keys, "
            f"e.g. {foreign[0]!r}"
        )
    # load_lora_into_transformer: no network alphas, the file's metadata, low_cpu_mem_usage (the
    # default of load_lora_weights with peft and transformers > 4.45.2)
    return state_dict, "transformer", dict(network_alphas=None, metadata=metadata, low_cpu_mem_usage=True)


# -- the ModelFns --------------------------------------------------------------------------------


class ZImageTextEncoder(ModelFn):
    """The prompt (and, with guidance, the negative prompt) through the Qwen3 encoder:
    ``prompt_embeds`` [tokens, hidden] and ``negative_prompt_embeds`` [tokens', hidden] (empty
    without guidance), padding removed."""

    fn_name = "zimage.text_encoder"

    def setup_io(self) -> None:
        self.add_input("prompt")
        self.add_input("negative_prompt")
        self.add_input("guidance_scale")
        self.add_input("max_sequence_length")
        self.add_output("prompt_embeds")
        self.add_output("negative_prompt_embeds")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        tokenizer = _component_class(model_path, "tokenizer").from_pretrained(
            model_path, subfolder="tokenizer"
        )
        text_encoder_cls = _component_class(model_path, "text_encoder")
        return with_loads(
            {
                "tokenizer": tokenizer,
                "text_encoder": load_component(text_encoder_cls, model_path, "text_encoder", device, loader),
            }
        )

    @staticmethod
    def _encode(components: dict[str, Any], prompt: str, max_sequence_length: int) -> torch.Tensor:
        """``_encode_prompt`` for one prompt: its embeddings without the padding."""
        tokenizer, text_encoder = components["tokenizer"], components["text_encoder"]
        device = text_encoder.device
        messages = [{"role": "user", "content": prompt}]
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=True
        )
        text_inputs = tokenizer(
            [text],
            padding="max_length",
            max_length=max_sequence_length,
            truncation=True,
            return_tensors="pt",
        )
        text_input_ids = text_inputs.input_ids.to(device)
        prompt_masks = text_inputs.attention_mask.to(device).bool()
        hidden = text_encoder(
            input_ids=text_input_ids, attention_mask=prompt_masks, output_hidden_states=True
        ).hidden_states[-2]
        return hidden[0][prompt_masks[0]]

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        max_length = int(inputs["max_sequence_length"])
        if max_length < 1:
            raise ValueError(f"max_sequence_length must be at least 1, got {max_length}")
        with torch.no_grad():
            prompt_embeds = self._encode(components, str(inputs["prompt"]), max_length)
            if _do_cfg(inputs["guidance_scale"]):
                # encode_prompt: a missing negative prompt is ""
                negative = str(inputs.get("negative_prompt") or "")
                negative_prompt_embeds = self._encode(components, negative, max_length)
            else:
                negative_prompt_embeds = prompt_embeds[:0]
        return {"prompt_embeds": prompt_embeds, "negative_prompt_embeds": negative_prompt_embeds}


class ZImagePrepareLatents(ModelFn):
    """Initial noise and schedule: ``latents`` [1, C, H/8, W/8] (fp32) and ``timesteps``
    [num_inference_steps] (fp32). Needs configs only, no weights."""

    fn_name = "zimage.prepare_latents"

    def setup_io(self) -> None:
        self.add_input("seed")
        self.add_input("height")
        self.add_input("width")
        self.add_input("num_inference_steps")
        self.add_output("latents")
        self.add_output("timesteps")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import ZImageTransformer2DModel

        transformer_config = ZImageTransformer2DModel.load_config(model_path, subfolder="transformer")
        return {
            "latent_channels": int(transformer_config["in_channels"]),
            "vae_scale": _vae_scale(model_path),
            "scheduler_config": _scheduler_config(model_path),
        }

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler
        from diffusers.utils.torch_utils import randn_tensor

        steps = int(inputs["num_inference_steps"])
        if steps < 1:
            raise ValueError(f"num_inference_steps must be at least 1, got {steps}")
        height, width, vae_scale = int(inputs["height"]), int(inputs["width"]), components["vae_scale"]
        # __call__'s first check
        if height % vae_scale != 0 or width % vae_scale != 0:
            raise ValueError(f"height and width must be divisible by {vae_scale} (got {height}x{width})")
        with torch.no_grad():
            # 4. prepare_latents: the generator's only draw, fp32
            shape = (1, components["latent_channels"], 2 * (height // vae_scale), 2 * (width // vae_scale))
            generator = torch.Generator(device="cpu").manual_seed(int(inputs["seed"]))
            latents = randn_tensor(
                shape, generator=generator, device=torch.device("cpu"), dtype=torch.float32
            )
            # 5. Prepare timesteps
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_timesteps(scheduler, steps, latents.shape, device="cpu")
        return {"latents": latents, "timesteps": scheduler.timesteps}


class ZImageTransformer(ModelFn):
    """One denoising step of ``ZImageTransformer2DModel`` with guidance: ``noise_pred``
    [1, C, H/8, W/8] (fp32), sign already flipped (what ``scheduler.step`` takes). Serves the
    ControlNet pipeline too: with ``controlnet_block_samples`` and ``controlnet_layer_places``
    bound (callbacks, fetched inside the forward) it is that pipeline's step."""

    fn_name = "zimage.transformer"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("guidance_scale")
        self.add_input("cfg_normalization")
        self.add_input("cfg_truncation")
        self.add_input("prompt_embeds")
        self.add_input("negative_prompt_embeds")
        self.add_input("controlnet_block_samples", callback=True, optional=True)
        self.add_input("controlnet_layer_places", callback=True, optional=True)
        self.add_input("lora", optional=True)
        self.add_input("lora_scale", optional=True)
        self.add_output("noise_pred")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import ZImageTransformer2DModel

        transformer = load_component(ZImageTransformer2DModel, model_path, "transformer", device, loader)
        return with_loads({"transformer": transformer, "lora": LoraSwitch(transformer, _load_zimage_lora)})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        transformer = components["transformer"]
        device, dtype = transformer.device, transformer.dtype
        lora_scale = inputs.get("lora_scale")
        components["lora"].use(inputs.get("lora") or None, 1.0 if lora_scale is None else float(lora_scale))
        cfg_normalization = float(inputs["cfg_normalization"] or 0.0)
        samples, places = inputs.get("controlnet_block_samples"), inputs.get("controlnet_layer_places")
        if (samples is None) != (places is None):
            raise ValueError("controlnet_block_samples and controlnet_layer_places are bound together")
        extra: dict[str, Any] = {}
        if samples is not None:
            extra["controlnet_block_samples"] = LazyBlockSamples(samples, places, device, dtype)
        with torch.no_grad():
            # 6. Denoising loop body
            guidance, apply_cfg, latent_list, timestep_model_input, embeds = guided_inputs(
                inputs, device, dtype
            )
            model_out_list = transformer(
                latent_list,
                timestep_model_input,
                embeds,
                joint_attention_kwargs=None,
                return_dict=False,
                **extra,
            )[0]
            if apply_cfg:
                pos, neg = model_out_list[0].float(), model_out_list[1].float()
                pred = pos + guidance * (pos - neg)
                if cfg_normalization > 0.0:  # renormalisation
                    ori_pos_norm = torch.linalg.vector_norm(pos)
                    new_pos_norm = torch.linalg.vector_norm(pred)
                    max_new_norm = ori_pos_norm * cfg_normalization
                    if new_pos_norm > max_new_norm:
                        pred = pred * (max_new_norm / new_pos_norm)
                noise_pred = torch.stack([pred], dim=0)
            else:
                noise_pred = torch.stack([out.float() for out in model_out_list], dim=0)
            noise_pred = -noise_pred.squeeze(2)
        return {"noise_pred": noise_pred}


class ZImageSchedulerStep(ModelFn):
    """One flow-matching Euler step, stateless: ``latents`` of step ``step + 1`` (see the module
    docstring). ``timesteps`` is the full ``num_inference_steps`` schedule or a tail of it."""

    fn_name = "zimage.scheduler_step"

    def setup_io(self) -> None:
        self.add_input("noise_pred")
        self.add_input("latents")
        self.add_input("timesteps")
        self.add_input("step")
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        return {"scheduler_config": _scheduler_config(model_path)}

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch
        from diffusers import FlowMatchEulerDiscreteScheduler

        latents = inputs["latents"]
        noise_pred = inputs["noise_pred"].to(latents.device)
        step, steps = int(inputs["step"]), int(inputs["num_inference_steps"])
        with torch.no_grad():
            # A fresh scheduler in the state the pipeline's is in at iteration `step`.
            scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
            _set_timesteps(scheduler, steps, latents.shape, device=latents.device)
            timesteps = inputs["timesteps"].to(latents.device)
            skipped = len(scheduler.timesteps) - len(timesteps)
            if skipped < 0 or not torch.equal(scheduler.timesteps[skipped:], timesteps):
                raise ValueError(
                    f"timesteps do not match a {steps}-step schedule for latents of shape {tuple(latents.shape)}"
                )
            if not 0 <= step < len(timesteps):
                raise ValueError(f"step {step} is outside the {len(timesteps)}-step schedule")
            scheduler.set_begin_index(skipped + step)
            # compute the previous noisy sample x_t -> x_t-1
            latents = scheduler.step(
                noise_pred.to(torch.float32), timesteps[step], latents, return_dict=False
            )[0]
        return {"latents": latents}


class ZImageVaeDecode(ModelFn):
    """Latents to pixels (``AutoencoderKL``): ``image``, a uint8 [H, W, 3] tensor equal to
    ``np.array`` of the pipeline's PIL image."""

    fn_name = "zimage.vae_decode"

    def setup_io(self) -> None:
        self.add_input("latents")
        self.add_output("image")

    def load_model(self, model_path: str, device: str, loader: Any = None) -> dict[str, Any]:
        from diffusers import AutoencoderKL
        from diffusers.image_processor import VaeImageProcessor

        vae = load_component(AutoencoderKL, model_path, "vae", device, loader)
        # ZImagePipeline.__init__: the processor works at twice the VAE's scale factor
        processor = VaeImageProcessor(vae_scale_factor=vae_scale_factor(vae.config) * 2)
        return with_loads({"vae": vae, "image_processor": processor})

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        vae, image_processor = components["vae"], components["image_processor"]
        with torch.no_grad():
            latents = inputs["latents"].to(device=vae.device, dtype=vae.dtype)
            latents = (latents / vae.config.scaling_factor) + vae.config.shift_factor
            image = vae.decode(latents, return_dict=False)[0]
            return {"image": to_uint8_image(image_processor, image)}
