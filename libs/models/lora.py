"""LoRA adapters per request on a shared executor: load once, switch per call, never fuse.

Executors keep the base model loaded and serve requests that name different adapters (or none).
Fusing would modify the base weights (fuse -> unfuse leaves them ~2e-7 off, measured on CPU),
so adapters stay separate PEFT layers: each file is loaded once under a name derived from its path,
``set_adapters`` selects it with the request's scale, and ``disable_lora`` returns the base output
bitwise. At most ``max_adapters`` stay loaded per model (least recently used are deleted).

Loading. A family's *loader* reads a file the way its pipeline's ``load_lora_weights`` does (the
pipeline's ``lora_state_dict``: key conversion, format checks, refusing layers its nodes do not
apply) and returns ``(state_dict, prefix)`` or ``(state_dict, prefix, kwargs)``; the switch calls
``model.load_lora_adapter(state_dict, prefix=prefix, adapter_name=name, **kwargs)``. The kwargs
carry what the pipeline's ``load_lora_into_*`` passes on, e.g. ``network_alphas`` and ``metadata``
(the alphas stored with a LoRA decide its scaling) or ``low_cpu_mem_usage``.

``requires_grad``. Loading an adapter makes peft freeze every base weight, and ``disable_lora``
leaves them frozen. The flag can change the bits even under ``no_grad`` (``F.linear`` on a
non-contiguous 3-D input folds it into one matmul or not depending on it, ~4e-7 apart; Sana's
linear attention feeds ``to_out`` such a tensor). With ``match_requires_grad=True`` the switch gives
the base weights the flags a pipeline's would have: while an adapter is active all frozen (as after
``load_lora_weights``), otherwise the flags the model had when the switch was made (a fresh
pipeline's). Off by default; ``sana.transformer`` turns it on (the other families leave the flags
as peft sets them).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# A loader turns a safetensors path into (state dict, prefix) or (state dict, prefix, keyword
# arguments for ``load_lora_adapter``); see the module docstring.
Loader = Callable[[str], tuple[Any, ...]]


def adapter_name(path: str) -> str:
    return "lora_" + hashlib.sha1(path.encode()).hexdigest()[:12]


class LoraSwitch:
    def __init__(
        self, model: Any, loader: Loader, max_adapters: int = 8, *, match_requires_grad: bool = False
    ) -> None:
        self.model = model
        self.loader = loader
        self.max_adapters = max_adapters
        self._loaded: OrderedDict[str, None] = OrderedDict()
        # (module, parameter name, requires_grad as the model came): see the module docstring. By
        # name, not by object: an executor's weight cache rebinds parameters to new tensors.
        self._base_flags = (
            [
                (mod, name, p.requires_grad)
                for mod in model.modules()
                for name, p in mod._parameters.items()  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API
                if p is not None
            ]
            if match_requires_grad
            else None
        )

    def use(self, path: str | None, scale: float = 1.0) -> None:
        """Activate the adapter at ``path`` with ``scale``; no path: the base model alone."""
        if path:
            self._activate(path, scale)
        elif self._loaded:
            self.model.disable_lora()
        if self._base_flags is not None:
            for mod, name, fresh in self._base_flags:
                mod._parameters[name].requires_grad_(False if path else fresh)  # noqa: SLF001 - torch's registry of a module's tensors: rebinding in place has no public API

    def _activate(self, path: str, scale: float) -> None:
        name = adapter_name(path)
        if name not in self._loaded:
            loaded = self.loader(path)
            state_dict, prefix = loaded[0], loaded[1]
            kwargs = loaded[2] if len(loaded) > 2 else {}
            self.model.load_lora_adapter(state_dict, prefix=prefix, adapter_name=name, **kwargs)
            self._loaded[name] = None
            while len(self._loaded) > self.max_adapters:
                old, _ = self._loaded.popitem(last=False)
                self.model.delete_adapters(old)
        self._loaded.move_to_end(name)
        self.model.enable_lora()
        self.model.set_adapters([name], [float(scale)])

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)
