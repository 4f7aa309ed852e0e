"""A user-written ModelFn: a post-processing step that inverts the image's colours."""

from __future__ import annotations

from typing import Any

from libs.sdk import ModelFn


class InvertImage(ModelFn):
    fn_name = "example.invert"

    def setup_io(self) -> None:
        self.add_input("image")
        self.add_output("image")

    def execute(self, components: dict[str, Any], image: Any) -> dict[str, Any]:
        return {"image": 255 - image}
