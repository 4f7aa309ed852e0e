"""What every model family does the same way, written once (the model math stays in each family).

Each family is a set of self-contained modules (diffusers' single-file philosophy):
``{family}.py`` (the base pipeline's ModelFns), ``{family}_controlnet.py`` (its ControlNet nodes),
``{family}_workflows.py`` (compositions of them) and ``tiny_{family}.py`` (a random-weight builder).
What is platform plumbing rather than a pipeline's math lives here:

* **Components.** :func:`load_component` loads every model with weights (instead of
  ``X.from_pretrained``): through a converted checkpoint (:mod:`libs.dataplane.checkpoint`) and the
  executor's :class:`~libs.dataplane.loader.Loader`, the model built on the meta device from its
  config as ``from_pretrained`` builds it and its parameters and buffers bound to the loaded tensors
  (no copies; bitwise the same weights). :func:`with_loads` records on a components dict which
  checkpoints a ``load_model`` loaded and how (``components["_loads"]``). :func:`config_dtype` (the
  dtype ``from_pretrained`` gives a transformers model) and :func:`vae_scale_factor` (every pipeline's
  ``__init__`` line). The device and the loader are arguments of
  ``ModelFn.load_model(model_path, device, loader)``; a node whose ``execute`` needs the device beyond
  its models' own ``.device`` keeps it in its components.
* **Schedules.** :func:`calculate_shift`, diffusers' function of that name (resolution-dependent
  ``mu``), copied as it is; each pipeline calls it with its own defaults.
* **Inpainting's blend.** :class:`FlowMatchInpaintBlend`: the lines every flow-matching inpainting
  pipeline runs after its Euler step (the picture's latents re-noised to the next timestep, then
  blended in where the mask keeps), written once; each family's subclass says how its scheduler is
  built and its timesteps set.
* **Decoded images.** :func:`to_uint8_image`: the pipelines' ``postprocess(output_type="pil")`` up to
  the PIL image, i.e. the uint8 array ``np.array(pipe(...).images[0])`` equals.
* **Callback inputs fetched mid-forward** (the paper, ServerlessT2I, arXiv 2607.26566: §5.2 and
  Fig. 8-right). A base model receives its ControlNet's outputs as a
  :class:`~libs.workflow.modelfn.Deferred`; handing the model a lazy stand-in instead of the fetched
  tensors lets its forward start at once, and the fetch happens when a block first touches the
  control outputs. :func:`lazy_list` wraps a list of block samples
  (``len``, indexing or iterating fetches; :class:`LazyList`), :func:`lazy_addend` one tensor the
  model only adds (``x + residual``, as a UNet does with its mid-block residual;
  :class:`LazyAddend`). Both accept an unbound input (None) and an already fetched value too.
* **Workflow variants.** Every family offers {basic, +ControlNet, +LoRA, +both} (the paper's setting
  S2): :data:`VARIANTS` and :func:`variant_workflows` generate them from one family composer, and
  :func:`controlnet_params` / :func:`lora_params` declare the parameters the variants add, with the
  same bounds in every family.

No torch, diffusers or transformers at import time: the registry imports the family modules (and so
this one) to read signatures in a process without them.
"""

from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libs.workflow.modelfn import ModelFn
from libs.workflow.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from libs.dataplane.loader import LoadedCheckpoint
    from libs.workflow.spec import WorkflowSpec

log = logging.getLogger(__name__)

LOADS = "_loads"  # the components key with_loads fills


# -- components ----------------------------------------------------------------------------------


def run_dtype(loader: Any) -> Any:
    """The dtype the executor loads this model at (``loader.dtype``), None: as ``from_pretrained``."""
    return getattr(loader, "dtype", None)


def config_dtype(model_path: str, subfolder: str, loaded_at: Any = None) -> torch.dtype:
    """The dtype ``from_pretrained`` gives a transformers model: ``loaded_at`` where the executor
    loads the model at one (``torch_dtype=``: a family's CUDA default or T2I_EXECUTOR_DTYPES;
    :func:`run_dtype`), else the one saved in its config."""
    import torch
    from transformers import AutoConfig

    if loaded_at is not None:
        dtype = loaded_at if isinstance(loaded_at, torch.dtype) else getattr(torch, str(loaded_at), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"{loaded_at!r} is not a torch dtype")
        return dtype
    dtype = AutoConfig.from_pretrained(model_path, subfolder=subfolder).dtype
    if isinstance(dtype, str):  # older configs spell it as a string
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def load_component(
    cls: type,
    model_path: str,
    subfolder: str | None = None,
    device: Any = "cpu",
    loader: Any = None,
    dtype: Any = None,
) -> Any:
    """``cls.from_pretrained(model_path, subfolder=subfolder)`` (with ``torch_dtype=dtype`` if given),
    on ``device``, in eval mode, through the fast path.

    The component is converted once (:func:`~libs.dataplane.checkpoint.ensure_converted`: again when
    its source changed or the checkpoint is corrupt) and loaded with ``loader`` (the process's default
    :class:`~libs.dataplane.loader.Loader` if None); the model is built on the meta device from its
    config exactly as ``from_pretrained`` configures it (transformers: the same dtype, attention
    implementation and init contexts), then every parameter and buffer, non-persistent and tied ones
    included, is bound to the loaded tensor of its name. A parameter or buffer left on the meta
    device, or a checkpoint tensor the model lacks, raises
    :class:`~libs.dataplane.errors.CheckpointMismatch`. The model keeps its
    :class:`~libs.dataplane.loader.LoadedCheckpoint` (:func:`loaded_checkpoint`), closed when the
    model is garbage collected. Where no checkpoint exists and none can be written (``OSError``),
    it warns and falls back to ``from_pretrained``."""
    from libs.dataplane.checkpoint import ensure_converted
    from libs.dataplane.errors import CorruptCheckpoint
    from libs.dataplane.loader import default_loader

    loader = loader if loader is not None else default_loader()
    if dtype is None:
        dtype = getattr(loader, "dtype", None)  # the executor's per-model dtype (T2I_EXECUTOR_DTYPES)
    component_dir = Path(model_path) / subfolder if subfolder else Path(model_path)
    try:
        ckpt = ensure_converted(component_dir, cls, dtype, chunk_bytes=loader.chunk_bytes)
    except OSError as e:
        # No converted checkpoint and none can be written (a read-only model store, a full disk):
        # slower, but the same model. ``python -m libs.dataplane.checkpoint convert`` fixes it.
        log.warning(
            "cannot convert %s for fast loading (%s); loading it with from_pretrained", component_dir, e
        )
        return _from_pretrained(cls, model_path, subfolder, device, dtype)
    try:
        loaded = loader.load(ckpt, device)
    except CorruptCheckpoint as e:
        # Never hand out wrong weights: check every chunk, convert again if it is really corrupt.
        log.warning("%s; checking and converting %s again", e, component_dir)
        ckpt = ensure_converted(component_dir, cls, dtype, verify_crc=True, chunk_bytes=loader.chunk_bytes)
        loaded = loader.load(ckpt, device)
    try:
        model = _build_on_meta(cls, model_path, subfolder, loaded)
        _bind(model, loaded)
    except BaseException:
        loaded.close()
        raise
    model.eval()
    model._t2i_checkpoint = loaded  # noqa: SLF001 - our attribute on a torch module: keeps its checkpoint mapped while it lives
    weakref.finalize(model, loaded.close)
    return model


def _from_pretrained(cls: type, model_path: str, subfolder: str | None, device: Any, dtype: Any) -> Any:
    kwargs: dict[str, Any] = {"subfolder": subfolder} if subfolder else {}
    if dtype is not None:
        kwargs["dtype" if cls.__module__.startswith("transformers") else "torch_dtype"] = dtype
    return cls.from_pretrained(model_path, **kwargs).to(device).eval()


def loaded_checkpoint(model: Any) -> LoadedCheckpoint | None:
    """The :class:`~libs.dataplane.loader.LoadedCheckpoint` a model was bound to by
    :func:`load_component` (None for a model loaded otherwise)."""
    return getattr(model, "__dict__", {}).get("_t2i_checkpoint")


def with_loads(components: dict[str, Any]) -> dict[str, Any]:
    """``components`` with ``components["_loads"]``: the load of every model among its values (or in
    lists/tuples of them) that :func:`load_component` loaded, so the executor can report where the
    weights came from (``source``: disk or host tier), how many bytes came from disk, and how long
    it took. Returns the same dict."""
    loads: list[LoadedCheckpoint] = []
    for value in components.values():
        for item in value if isinstance(value, (list, tuple)) else (value,):
            loaded = loaded_checkpoint(item)
            if loaded is not None and all(loaded is not seen for seen in loads):
                loads.append(loaded)
    components[LOADS] = loads
    return components


def _build_on_meta(cls: type, model_path: str, subfolder: str | None, loaded: LoadedCheckpoint) -> Any:
    """``cls`` built from its config on the meta device, configured as ``from_pretrained`` does."""
    import torch

    info = loaded.index.model
    if info.library == "transformers":
        from transformers.modeling_utils import patch_output_recorders
        from transformers.utils.generic import ContextManagers

        # PreTrainedModel.from_pretrained: the config (dtype "auto": the resolved dtype, recorded by
        # the conversion), name_or_path, then the model under get_init_context (meta device, dtype).
        config = cls.config_class.from_pretrained(model_path, subfolder=subfolder or "")
        dtype = getattr(torch, info.dtype)
        config.dtype = dtype
        for key in config.sub_configs:
            if (sub := getattr(config, key, None)) is not None:
                sub.dtype = dtype
        config.name_or_path = model_path
        with ContextManagers(cls.get_init_context(dtype, False, False, False)):
            model = cls(config)
            patch_output_recorders(model)
        attn = getattr(model.config, "_attn_implementation", None)
        if info.attn_implementation is not None and attn != info.attn_implementation:
            log.warning(
                "%s from %s: attention implementation %r, converted with %r",
                cls.__name__, model_path, attn, info.attn_implementation,
            )  # fmt: skip
        return model
    from diffusers.models.modeling_utils import no_init_weights

    # ModelMixin.from_pretrained: load_config, from_config under no_init_weights and empty weights
    # (here: the meta device, buffers too, as every buffer is bound from the checkpoint), then
    # register _name_or_path.
    config, unused = cls.load_config(model_path, subfolder=subfolder, return_unused_kwargs=True)
    config = copy.deepcopy(config)
    requested = loaded.index.source.dtype
    dtype_orig = cls._set_default_torch_dtype(getattr(torch, requested)) if requested != "native" else None
    try:
        with no_init_weights(), torch.device("meta"):
            model = cls.from_config(config, **unused)
    finally:
        if dtype_orig is not None:
            torch.set_default_dtype(dtype_orig)
    model.register_to_config(_name_or_path=model_path)
    return model


def _bind(model: Any, loaded: LoadedCheckpoint) -> None:
    """Point every parameter and buffer of ``model`` at the loaded tensor of its name (tied names at
    the same tensor object); raise CheckpointMismatch for anything left on the meta device."""
    import torch

    from libs.dataplane.errors import CheckpointMismatch

    what = type(model).__name__
    bound: dict[str, torch.Tensor] = {}
    unknown, wrong = [], []
    for e in loaded.index.tensors:
        path, _, attr = e.name.rpartition(".")
        try:
            mod = model.get_submodule(path)
        except AttributeError:
            unknown.append(e.name)
            continue
        table = mod._parameters if e.kind == "parameter" else mod._buffers  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API
        if attr not in table:
            unknown.append(e.name)
            continue
        old = table[attr]
        if e.alias_of is not None:
            value = bound[e.alias_of]
        else:
            value = loaded.tensors[e.name]
            if e.kind == "parameter":
                value = torch.nn.Parameter(value, requires_grad=e.requires_grad)
        if old is not None and tuple(old.shape) != tuple(value.shape):
            wrong.append(f"{e.name} {list(old.shape)} != {list(value.shape)}")
            continue
        table[attr] = value
        bound[e.name] = value
    if unknown:
        raise CheckpointMismatch(str(loaded.path), what, "tensors the model does not have", unknown)
    if wrong:
        raise CheckpointMismatch(str(loaded.path), what, "shapes differ", wrong)
    left = [n for n, t in model.named_parameters(remove_duplicate=False) if t.is_meta]
    left += [n for n, t in model.named_buffers(remove_duplicate=False) if t.is_meta]
    left += [
        f"{path}.{attr}" if path else attr
        for path, mod in model.named_modules()
        for attr, v in vars(mod).items()
        if isinstance(v, torch.Tensor) and v.is_meta
    ]
    if left:
        raise CheckpointMismatch(
            str(loaded.path), what, "left on the meta device (not in the checkpoint)", left
        )


def vae_scale_factor(vae_config: Any, key: str = "block_out_channels") -> int:
    """``2 ** (len(vae.config.<key>) - 1)``, as the pipelines' ``__init__`` computes it from their VAE's
    config (``AutoencoderKL``: ``block_out_channels``; Sana's ``AutoencoderDC``:
    ``encoder_block_out_channels``)."""
    return int(2 ** (len(vae_config[key]) - 1))


# -- schedules -----------------------------------------------------------------------------------


def calculate_shift(
    image_seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """``mu`` of the resolution-dependent timestep shift: diffusers' ``calculate_shift``
    (``diffusers.pipelines.flux.pipeline_flux``), the same operations in the same order, so the
    same float. Callers pass their scheduler config's values with their pipeline's defaults."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    mu = image_seq_len * m + b
    return mu


# -- inpainting's blend ----------------------------------------------------------------------------


class FlowMatchInpaintBlend(ModelFn):
    """Base of the flow-matching inpainting blends (``flux.inpaint_blend``, ``sd3.inpaint_blend``,
    ``zimage.inpaint_blend``, ``flux2.inpaint_blend``, ``qwenimage.inpaint_blend``): the lines their pipelines
    (``FluxInpaintPipeline``, ``StableDiffusion3InpaintPipeline``, ``ZImageInpaintPipeline``,
    ``Flux2KleinInpaintPipeline``, ``QwenImageInpaintPipeline``) run after each
    ``scheduler.step``::

        init_latents_proper = image_latents
        if i < len(timesteps) - 1:
            noise_timestep = timesteps[i + 1]
            init_latents_proper = self.scheduler.scale_noise(
                init_latents_proper, torch.tensor([noise_timestep]), noise
            )
        latents = (1 - init_mask) * init_latents_proper + init_mask * latents

    ``scale_noise`` reads the sigma of the scheduler's ``step_index``, which is ``i + 1`` after the
    step; the node, stateless, builds a fresh ``FlowMatchEulerDiscreteScheduler`` in the pipeline's
    state (:meth:`scheduler`), checks its timesteps against the carried ``timesteps`` and pins
    ``set_begin_index(step + 1)``. At the last step the picture's latents go in as they are.

    Inputs: ``latents`` (after step ``step``), the picture's latents (:attr:`image_input`), ``noise``,
    ``init_mask`` (all as the family's preparation lays them out: packed tokens or [B, C, H, W]),
    ``timesteps`` (the whole schedule), ``step`` and ``num_inference_steps``; output ``latents``.

    A family's subclass sets ``fn_name`` (and :attr:`image_input` when its preparation names the
    picture's latents otherwise), loads what its scheduler needs in ``load_model`` (configs only,
    no weights: ``scheduler_config`` at least) and implements :meth:`set_timesteps` (or
    :meth:`scheduler`, building its scheduler its own way); :meth:`schedule_for` words the refusal
    of timesteps that do not match (packed tokens by default). No torch at import time."""

    image_input = "image_latents"  # the input holding the picture's (unnoised) latents

    def setup_io(self) -> None:
        for name in ("latents", self.image_input, "noise", "init_mask", "timesteps", "step"):
            self.add_input(name)
        self.add_input("num_inference_steps")
        self.add_output("latents")

    def scheduler(self, components: dict[str, Any], num_inference_steps: int, latents: torch.Tensor) -> Any:
        """A fresh scheduler in the state the pipeline's is in before its first step: by default
        ``FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])`` with
        :meth:`set_timesteps`; a family that builds its scheduler otherwise overrides this."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        scheduler = FlowMatchEulerDiscreteScheduler.from_config(components["scheduler_config"])
        self.set_timesteps(components, scheduler, num_inference_steps, latents)
        return scheduler

    def set_timesteps(
        self, components: dict[str, Any], scheduler: Any, num_inference_steps: int, latents: torch.Tensor
    ) -> None:
        """The family pipeline's ``set_timesteps`` (or ``retrieve_timesteps``) call for ``latents``,
        on ``latents.device``."""
        raise NotImplementedError(f"{type(self).__name__} must implement set_timesteps()")

    def schedule_for(self, latents: torch.Tensor) -> str:
        """What the schedule depends on, for the error message: packed latents' token count."""
        return f"{latents.shape[1]} latent tokens"

    def execute(self, components: dict[str, Any], **inputs: Any) -> dict[str, Any]:
        import torch

        latents = inputs["latents"]
        device = latents.device
        init_latents_proper = inputs[self.image_input].to(device)
        init_mask = inputs["init_mask"].to(device)
        timesteps, step = inputs["timesteps"].to(device), int(inputs["step"])
        with torch.no_grad():
            if step < len(timesteps) - 1:
                steps = int(inputs["num_inference_steps"])
                scheduler = self.scheduler(components, steps, latents)
                if not torch.equal(scheduler.timesteps, timesteps):
                    raise ValueError(
                        f"timesteps do not match a {steps}-step schedule for {self.schedule_for(latents)}"
                    )
                # the pipeline's scheduler is at step_index step + 1 here; scale_noise reads its sigma
                scheduler.set_begin_index(step + 1)
                init_latents_proper = scheduler.scale_noise(
                    init_latents_proper, torch.tensor([timesteps[step + 1]]), inputs["noise"].to(device)
                )
            latents = (1 - init_mask) * init_latents_proper + init_mask * latents
        return {"latents": latents}


# -- decoded images --------------------------------------------------------------------------------


def to_uint8_image(image_processor: Any, image: torch.Tensor, **postprocess: Any) -> torch.Tensor:
    """A decoded batch of one as a uint8 [H, W, 3] tensor equal to ``np.array`` of the pipeline's
    PIL image: ``postprocess(output_type="pil")`` is ``postprocess(output_type="np")`` then
    ``numpy_to_pil``'s ``(x * 255).round().astype("uint8")``; this stops before building the PIL
    image. ``postprocess`` are further ``image_processor.postprocess`` arguments (``do_denormalize``)."""
    import torch

    array = image_processor.postprocess(image, output_type="np", **postprocess)
    array = (array * 255).round().astype("uint8")
    return torch.from_numpy(array[0].copy())


# -- callback inputs fetched mid-forward -----------------------------------------------------------


class LazyList(Sequence):
    """Stands in for a list of block samples: ``len``, indexing or iterating fetches, once;
    ``pick`` turns the fetched value into the list (e.g. moves each sample to the model's device)."""

    def __init__(self, fetch: Callable[[], Any], pick: Callable[[Any], Sequence] = lambda v: v) -> None:
        self._fetch = fetch
        self._pick = pick
        self._items: Sequence | None = None

    def _get(self) -> Sequence:
        if self._items is None:
            self._items = list(self._pick(self._fetch()))
        return self._items

    @property
    def fetched(self) -> bool:
        return self._items is not None

    def __len__(self) -> int:
        return len(self._get())

    def __getitem__(self, i):  # type: ignore[override]
        return self._get()[i]

    def __iter__(self) -> Iterator:
        return iter(self._get())


class LazyAddend:
    """``x + LazyAddend(fetch)`` fetches and adds (torch returns NotImplemented to unknown types)."""

    def __init__(self, fetch: Callable[[], Any]) -> None:
        self._fetch = fetch
        self._value: Any = None

    def value(self) -> Any:
        if self._value is None:
            self._value = self._fetch()
        return self._value

    @property
    def fetched(self) -> bool:
        return self._value is not None

    def __radd__(self, other: Any) -> Any:
        return other + self.value()

    def __add__(self, other: Any) -> Any:
        return self.value() + other


def _fetcher(value: Any) -> Callable[[], Any]:
    # A Deferred is called to fetch; a value handed in directly (a test calling execute) is returned.
    return value if callable(value) else (lambda: value)


def lazy_list(value: Any, pick: Callable[[Any], Sequence]) -> LazyList | None:
    """A callback input that is a list of block samples, as a model's forward wants it: None when the
    workflow leaves it unbound, else a :class:`LazyList` that fetches at the forward's first use and
    applies ``pick`` to what it fetched."""
    if value is None:
        return None
    return LazyList(_fetcher(value), pick)


def lazy_addend(value: Any, convert: Callable[[Any], Any]) -> LazyAddend | None:
    """A callback input that the model only adds to a tensor: None when unbound, else a
    :class:`LazyAddend` that fetches (and applies ``convert``) when the addition runs."""
    if value is None:
        return None
    fetch = _fetcher(value)
    return LazyAddend(lambda: convert(fetch()))


# -- workflow variants -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One of a family's workflow variants: its name suffix and what it adds to the basic workflow."""

    suffix: str
    controlnet: bool
    lora: bool

    def describe(self, base: str) -> str:
        extras = " + ".join(x for x, on in (("ControlNet", self.controlnet), ("LoRA", self.lora)) if on)
        return f"{base} with {extras}" if extras else base


VARIANTS: tuple[Variant, ...] = (
    Variant("", controlnet=False, lora=False),
    Variant("-controlnet", controlnet=True, lora=False),
    Variant("-lora", controlnet=False, lora=True),
    Variant("-controlnet-lora", controlnet=True, lora=True),
)


def variant_workflows(
    name: str, description: str, compose: Callable[[str, Variant, str], WorkflowSpec]
) -> list[WorkflowSpec]:
    """The four variants of one workflow, in :data:`VARIANTS` order: ``compose(name + suffix,
    variant, description)`` for each, with ``description`` extended by what the variant adds."""
    return [compose(name + v.suffix, v, v.describe(description)) for v in VARIANTS]


def controlnet_params() -> dict[str, ParamSpec]:
    """The parameters a ControlNet variant adds. ``control_scale`` is the pipelines'
    ``controlnet_conditioning_scale`` (default 1.0 in every family)."""
    return {
        "control_image": ParamSpec(
            type="image", required=True, description="ControlNet condition (e.g. an edge map), RGB"
        ),
        "control_scale": ParamSpec(
            type="float",
            default=1.0,
            minimum=0.0,
            maximum=4.0,
            description="ControlNet conditioning scale (controlnet_conditioning_scale)",
        ),
    }


def lora_params() -> dict[str, ParamSpec]:
    """The parameters a LoRA variant adds: a registered adapter of the denoiser (UNet or
    transformer; ``""`` = none) and its scale, the weight ``set_adapters`` gives it."""
    return {
        "lora": ParamSpec(
            type="lora", default="", description="a registered LoRA adapter of the denoiser; empty: none"
        ),
        "lora_scale": ParamSpec(
            type="float", default=1.0, minimum=-4.0, maximum=4.0, description="LoRA weight"
        ),
    }


def edit_params(*, strength: float, inpaint: bool) -> dict[str, ParamSpec]:
    """The parameters of an image-to-image workflow (with ``inpaint``, of an inpainting one): the
    picture ``image``, the ``mask`` (diffusers' convention: white is repainted, black kept) and
    ``strength``, the share of the schedule that runs (0 < strength <= 1; ``strength`` is the
    pipeline's default). The gateway's ``/v1/images/edits`` maps its uploads onto ``image`` and
    ``mask``; a workflow with a ``mask`` parameter is one that inpaints."""
    params = {
        "image": ParamSpec(type="image", required=True, description="the picture to start from, RGB"),
        "strength": ParamSpec(
            type="float",
            default=strength,
            minimum=0.0,
            maximum=1.0,
            description="how much to change the picture: the share of the denoising steps that run",
        ),
    }
    if inpaint:
        params["mask"] = ParamSpec(
            type="image", required=True, description="where to repaint: white repainted, black kept"
        )
    return params
