"""What loading the Qwen-Image components needs beyond :func:`~libs.models.common.load_component`.

* :func:`rope_tables_on_cpu`: ``QwenEmbedRope`` (the transformer's ``pos_embed``) keeps its
  frequency tables as plain complex tensors, not buffers (a buffer would lose the imaginary part),
  so no checkpoint holds them and a model built on the meta device would keep them there.
* :func:`vl_processor`: ``Qwen2VLProcessor`` insists on a video processor, which needs
  torchvision. The edit folder's ``processor`` holds the tokenizer and the image processor;
  where ``from_pretrained`` cannot build the processor it is built from those two, without the
  video half (an image prompt never uses it): the same ``__call__``, the same token ids and pixels.

No torch, diffusers or transformers at import time.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_ROPE_LOCK = threading.Lock()  # one patched QwenEmbedRope.__init__ at a time


@contextmanager
def rope_tables_on_cpu() -> Iterator[None]:
    """Inside this context ``QwenEmbedRope`` computes its tables on the CPU, as under
    ``from_pretrained`` (the same values), even while the model is built on the meta device."""
    import torch
    from diffusers.models.transformers import transformer_qwenimage

    rope = transformer_qwenimage.QwenEmbedRope
    original = rope.__init__

    def init_on_cpu(self: Any, *args: Any, **kwargs: Any) -> None:
        with torch.device("cpu"):
            original(self, *args, **kwargs)

    with _ROPE_LOCK:
        rope.__init__ = init_on_cpu  # type: ignore[method-assign]
        try:
            yield
        finally:
            rope.__init__ = original  # type: ignore[method-assign]


def vl_processor(model_path: str) -> Any:
    """The edit folder's ``Qwen2VLProcessor``: ``from_pretrained``, or where that cannot build its
    video processor, the same class over the saved tokenizer and image processor."""
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen2VLProcessor

    try:
        return Qwen2VLProcessor.from_pretrained(model_path, subfolder="processor")
    except (ImportError, ValueError, AttributeError, OSError):
        pass

    class ImageTextProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    return ImageTextProcessor(
        image_processor=AutoImageProcessor.from_pretrained(model_path, subfolder="processor"),
        tokenizer=AutoTokenizer.from_pretrained(model_path, subfolder="processor"),
        video_processor=None,
    )
