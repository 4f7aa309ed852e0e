"""The Qwen-Image ControlNet ModelFns: none yet.

``QwenImageControlNetPipeline`` (``diffusers/pipelines/qwenimage/pipeline_qwenimage_controlnet.py``,
diffusers 0.42.1) is not mirrored; the module exists because every family has one
(:mod:`libs.models.families`' naming scheme), and the catalog has no ``tiny-qwenimage-controlnet``
workflow. ``qwenimage.transformer`` would take the ControlNet's ``controlnet_block_samples`` as a
callback input, as the other families' denoisers do.
"""

from __future__ import annotations
