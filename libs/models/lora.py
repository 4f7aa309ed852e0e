"""LoRA adapters per request on a shared executor: load once, switch per call, never fuse.

Executors keep the base model loaded and serve requests that name different adapters (or none).
Fusing would modify the base weights (fuse -> unfuse leaves them ~2e-7 off: NOTES-diffusers.md),
so adapters stay separate PEFT layers: each file is loaded once under a name derived from its path,
``set_adapters`` selects it with the request's scale, and ``disable_lora`` returns the base output
bitwise. At most ``max_adapters`` stay loaded per model (least recently used are deleted).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

# A loader turns a safetensors path into (state dict, prefix) — or (state dict, prefix, extra
# keyword arguments such as ``network_alphas`` / ``metadata``) — for ``load_lora_adapter``. Each
# family's pipeline has its own key conventions (``XLoraLoaderMixin.lora_state_dict``), and the
# alphas stored with a LoRA decide its scaling: a loader must pass them on.
Loader = Callable[[str], tuple[Any, ...]]


def adapter_name(path: str) -> str:
    return "lora_" + hashlib.sha1(path.encode()).hexdigest()[:12]


class LoraSwitch:
    def __init__(self, model: Any, loader: Loader, max_adapters: int = 8) -> None:
        self.model = model
        self.loader = loader
        self.max_adapters = max_adapters
        self._loaded: OrderedDict[str, None] = OrderedDict()

    def use(self, path: str | None, scale: float = 1.0) -> None:
        """Activate the adapter at ``path`` with ``scale``; no path: the base model alone."""
        if not path:
            if self._loaded:
                self.model.disable_lora()
            return
        name = adapter_name(path)
        if name not in self._loaded:
            loaded = self.loader(path)
            state_dict, prefix = loaded[0], loaded[1]
            extra = loaded[2] if len(loaded) > 2 else {}
            self.model.load_lora_adapter(state_dict, prefix=prefix, adapter_name=name, **extra)
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
