"""Step caching that survives per-step placement: a diffusers cache hook whose state travels as tensors.

diffusers' caching hooks (First-Block-Cache here) keep what they carry from one denoising step to the
next in a ``StateManager`` inside the model: the previous step's first-block residual and the
residuals of the blocks after it. On this platform consecutive steps may run on different executors
and a lost step is re-run by lineage, so that state cannot live in the module. Instead a denoiser
node, per call:

1. makes sure the request's cache hooks are on its model (``apply_first_block_cache``, what
   ``enable_cache`` applies; applied at the first cached call and kept while cached calls follow,
   removed by an uncached one),
2. puts the state it received (its ``cache_state`` input: the previous step's ``cache_state``
   output) into the hooks' state managers,
3. runs the forward under the pipeline's ``cache_context`` names, exactly as the pipeline does,
4. takes the state back out as its ``cache_state`` output.

The hooks are diffusers' own, so a cached request equals the pipeline with the same hook enabled
bit for bit, wherever its steps ran. With caching off (``cache=""``) no hook is applied and the
state is an empty list: the images are those of today.

The state on the wire is a list of tensors: the first a uint8 tensor holding a JSON description of
every state manager's per-context state objects (attribute names, nesting, scalars), the others the
tensors it refers to by index. The description is rebuilt into the hooks' own state classes.

Which families offer it: those whose transformer diffusers' First-Block-Cache runs on, Flux (dev,
schnell, with ControlNet and LoRA; not the cfg-parallel workflow, whose two transformer nodes a step
would need two states) and Qwen-Image (generation, ControlNet, LoRA and the edits). It raises inside
diffusers on Flux.2 Klein (its single-stream tail block returns a tensor where the head block
returned a pair), SD3 (the last joint block returns no text stream) and Z-Image (its blocks take
``x``, not ``hidden_states``); Sana's blocks are not registered with the hooks at all.

Per-request parameters (:func:`cache_params`): ``cache`` (``""`` or ``"first_block"``) and
``cache_threshold`` (First-Block-Cache's relative first-block residual change below which the
remaining blocks are skipped and the cached residuals reused; diffusers' default 0.05).

No torch or diffusers at import time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from libs.workflow.spec import ParamSpec

if TYPE_CHECKING:
    import torch

METHODS = ("", "first_block")  # "" = off
DEFAULT_THRESHOLD = 0.05  # FirstBlockCacheConfig's


def cache_params() -> dict[str, ParamSpec]:
    """The parameters a DiT workflow takes for step caching (off by default)."""
    return {
        "cache": ParamSpec(
            type="str",
            default="",
            choices=list(METHODS),
            description="step caching: '' (off) or 'first_block' (First-Block-Cache)",
        ),
        "cache_threshold": ParamSpec(
            type="float",
            default=DEFAULT_THRESHOLD,
            minimum=0.0,
            maximum=1.0,
            description="First-Block-Cache: skip the remaining blocks while the first block's residual "
            "changes by less than this (relative)",
        ),
    }


@dataclass(frozen=True)
class CacheSpec:
    method: str
    threshold: float

    def config(self) -> Any:
        from diffusers.hooks import FirstBlockCacheConfig

        if self.method == "first_block":
            return FirstBlockCacheConfig(threshold=self.threshold)
        raise ValueError(f"unknown cache method {self.method!r}; one of {[m for m in METHODS if m]}")


def cache_spec(inputs: dict[str, Any]) -> CacheSpec | None:
    """The request's cache from a denoiser's (optional) ``cache`` / ``cache_threshold`` inputs, or
    None when caching is off or the workflow does not offer it."""
    method = inputs.get("cache") or ""
    if method == "":
        return None
    if method not in METHODS:
        raise ValueError(f"cache must be one of {list(METHODS)}, not {method!r}")
    threshold = inputs.get("cache_threshold")
    threshold = DEFAULT_THRESHOLD if threshold is None else float(threshold)
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"cache_threshold must be within [0, 1], got {threshold}")
    return CacheSpec(method, threshold)


def supports_caching(model: Any) -> bool:
    """Whether diffusers' First-Block-Cache can hook ``model``: its block classes are registered."""
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS
    from diffusers.hooks._helpers import TransformerBlockRegistry

    blocks = [
        block
        for name, child in model.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and hasattr(child, "__iter__")
        for block in child
    ]
    if len(blocks) < 2:
        return False
    try:
        for block in blocks:
            TransformerBlockRegistry.get(type(block))
    except ValueError:
        return False
    return True


# -- the state on the wire -------------------------------------------------------------------------


def _state_managers(model: Any) -> list[Any]:
    """The hooks' state managers under ``model``, in registration order, each once."""
    from diffusers.hooks.hooks import HookRegistry, StateManager

    # diffusers has no public walk of a model's hooks; _set_cache_context walks them this way.
    registry = HookRegistry.check_if_exists_or_initialize(model)
    seen: dict[int, Any] = {}
    for child in (registry, *registry._get_child_registries()):  # noqa: SLF001 - see above
        for hook_name in child._hook_order:  # noqa: SLF001 - see above
            for attr in vars(child.hooks[hook_name]).values():
                if isinstance(attr, StateManager):
                    seen.setdefault(id(attr), attr)
    return list(seen.values())


def _contexts(manager: Any) -> dict[str, Any]:
    """A state manager's per-context states (``StateManager._state_cache``, which ``get_state``
    fills; there is no public accessor)."""
    return manager._state_cache  # noqa: SLF001 - see the docstring


def _fresh(manager: Any) -> Any:
    """A new state object of the manager's class, as ``get_state`` builds one."""
    return manager._state_cls(*manager._init_args, **manager._init_kwargs)  # noqa: SLF001 - as get_state


def _encode(value: Any, tensors: list[torch.Tensor]) -> Any:
    import torch

    if isinstance(value, torch.Tensor):
        tensors.append(value.detach())
        return {"t": len(tensors) - 1}
    if isinstance(value, tuple | list):
        return {"tuple" if isinstance(value, tuple) else "list": [_encode(v, tensors) for v in value]}
    if value is None or isinstance(value, bool | int | float | str):
        return {"v": value}
    raise TypeError(f"step cache state holds a {type(value).__name__}, which cannot travel")


def _decode(node: Any, tensors: list[torch.Tensor], device: Any) -> Any:
    if "t" in node:
        return tensors[int(node["t"])].to(device)
    if "tuple" in node:
        return tuple(_decode(v, tensors, device) for v in node["tuple"])
    if "list" in node:
        return [_decode(v, tensors, device) for v in node["list"]]
    return node["v"]


def export_state(model: Any) -> list[torch.Tensor]:
    """The hooks' state as ``[json header (uint8), *tensors]``."""
    import torch

    tensors: list[torch.Tensor] = []
    managers = [
        {
            name: {k: _encode(v, tensors) for k, v in vars(state).items()}
            for name, state in _contexts(m).items()
        }
        for m in _state_managers(model)
    ]
    header = torch.frombuffer(bytearray(json.dumps(managers, sort_keys=True).encode()), dtype=torch.uint8)
    return [header.clone(), *tensors]


def import_state(model: Any, state: list[torch.Tensor], device: Any) -> None:
    """Put a state :func:`export_state` gave into the hooks of ``model``, replacing whatever state
    they hold (another request's, or this request's from a step run elsewhere)."""
    if not state:  # the first step: fresh state, as the pipeline's first step
        for manager in _state_managers(model):
            _contexts(manager).clear()
        return
    header, tensors = state[0], list(state[1:])
    try:
        managers = json.loads(bytes(header.to("cpu", dtype=header.dtype).numpy().tobytes()).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"cache_state: its header is not the JSON a cached step writes ({e})") from e
    ours = _state_managers(model)
    if not isinstance(managers, list) or len(managers) != len(ours):
        raise ValueError(
            f"cache_state: {len(managers) if isinstance(managers, list) else 'no'} state managers, "
            f"the model's cache has {len(ours)} (another cache method or model?)"
        )
    for manager, contexts in zip(ours, managers, strict=True):
        states = _contexts(manager)
        states.clear()
        for name, attrs in contexts.items():
            state_obj = _fresh(manager)
            for key, node in attrs.items():
                setattr(state_obj, key, _decode(node, tensors, device))
            states[name] = state_obj


def _apply(model: Any, spec: CacheSpec) -> None:
    from diffusers.hooks import HookRegistry, apply_first_block_cache

    apply_first_block_cache(model, spec.config())
    # as enable_cache: the block hooks stale the cached list of child registries that a cache
    # context update walks
    HookRegistry.check_if_exists_or_initialize(model).invalidate_child_registries_cache()


def _remove(model: Any) -> None:
    """What ``CacheMixin.disable_cache`` does for First-Block-Cache."""
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.first_block_cache import _FBC_BLOCK_HOOK, _FBC_LEADER_BLOCK_HOOK

    registry = HookRegistry.check_if_exists_or_initialize(model)
    registry.remove_hook(_FBC_LEADER_BLOCK_HOOK, recurse=True)
    registry.remove_hook(_FBC_BLOCK_HOOK, recurse=True)
    registry.invalidate_child_registries_cache()


_INSTALLED = "_t2i_step_cache"  # our attribute on a model: the CacheSpec its hooks were applied with


def _install(model: Any, spec: CacheSpec | None) -> None:
    """Leave ``model`` hooked for ``spec`` (None: unhooked). Hooks stay between calls, so a run of
    cached steps pays for applying them once; only a change of method, or an uncached call after
    cached ones, applies or removes them. A change of threshold is set on the head hooks."""
    current = getattr(model, _INSTALLED, None)
    if current == spec:
        return
    if spec is None or current is None or current.method != spec.method:
        if current is not None:
            _remove(model)
            setattr(model, _INSTALLED, None)
        if spec is not None:
            _apply(model, spec)
            setattr(model, _INSTALLED, spec)
        return
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.first_block_cache import FBCHeadBlockHook

    registry = HookRegistry.check_if_exists_or_initialize(model)
    for child in (registry, *registry._get_child_registries()):  # noqa: SLF001 - see _state_managers
        for hook in child.hooks.values():
            if isinstance(hook, FBCHeadBlockHook):
                hook.threshold = spec.threshold
    setattr(model, _INSTALLED, spec)


@contextmanager
def step_cache(model: Any, inputs: dict[str, Any], out: dict[str, Any]) -> Iterator[None]:
    """Run the body (the forwards of one denoising step) with the request's cache on ``model``,
    its state taken from ``inputs["cache_state"]`` and left in ``out["cache_state"]`` (an empty
    list with caching off). The body must call the model under its ``cache_context`` with the
    names the pipeline uses (a pipeline that names none needs one for the hook: ``"cond"``). The
    hook is diffusers' ``apply_first_block_cache``, which ``enable_cache`` applies on models with
    ``CacheMixin``; it stays on the model between calls (:func:`_install`), its state replaced by
    each call's input, so no state leaks from one request (or step) into another."""
    spec = cache_spec(inputs)
    if spec is not None and not supports_caching(model):
        raise ValueError(f"{type(model).__name__}: diffusers' First-Block-Cache cannot hook its blocks")
    _install(model, spec)
    if spec is None:
        out["cache_state"] = []
        yield
        return
    try:
        import_state(model, list(inputs.get("cache_state") or []), next(model.parameters()).device)
        yield
        out["cache_state"] = export_state(model)
    except BaseException:
        _install(model, None)  # a failed call leaves no half-updated state behind
        raise
