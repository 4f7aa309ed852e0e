"""Helpers every model family needs in the same form (family-specific ones stay in each module)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def device() -> torch.device:
    """Where ModelFns put their models: ``$T2I_DEVICE`` (the executor sets it), default the CPU."""
    import torch

    return torch.device(os.environ.get("T2I_DEVICE", "cpu"))


def config_dtype(model_path: str, subfolder: str) -> torch.dtype:
    """The dtype ``from_pretrained`` gives a transformers model: the one saved in its config."""
    import torch
    from transformers import AutoConfig

    dtype = AutoConfig.from_pretrained(model_path, subfolder=subfolder).dtype
    if isinstance(dtype, str):  # older configs spell it as a string
        dtype = getattr(torch, dtype)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32
