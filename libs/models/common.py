"""What every model family does the same way, written once (the model math stays in each family).

Each family is a set of self-contained modules (diffusers' single-file philosophy):
``{family}.py`` (the base pipeline's ModelFns), ``{family}_controlnet.py`` (its ControlNet nodes),
``{family}_workflows.py`` (compositions of them) and ``tiny_{family}.py`` (a random-weight builder).
What is platform plumbing rather than a pipeline's math lives here:

* **Components.** :func:`config_dtype` (the dtype ``from_pretrained`` gives a transformers model)
  and :func:`vae_scale_factor` (every pipeline's ``__init__`` line). The device is an argument of
  ``ModelFn.load_model(model_path, device)``; a node whose ``execute`` needs it beyond its models'
  own ``.device`` keeps it in its components.
* **Schedules.** :func:`calculate_shift`, diffusers' function of that name (resolution-dependent
  ``mu``), copied as it is; each pipeline calls it with its own defaults.
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

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from libs.workflow.spec import ParamSpec

if TYPE_CHECKING:
    import torch

    from libs.workflow.spec import WorkflowSpec


# -- components ----------------------------------------------------------------------------------


def config_dtype(model_path: str, subfolder: str) -> torch.dtype:
    """The dtype ``from_pretrained`` gives a transformers model: the one saved in its config."""
    import torch
    from transformers import AutoConfig

    dtype = AutoConfig.from_pretrained(model_path, subfolder=subfolder).dtype
    if isinstance(dtype, str):  # older configs spell it as a string
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


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
