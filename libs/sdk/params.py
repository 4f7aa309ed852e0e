"""Typed workflow parameters with defaults: ``Param.int(4, minimum=1)`` and friends."""

from __future__ import annotations

from libs.workflow.spec import ParamSpec


class Param:
    @staticmethod
    def int(
        default: int | None = None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        required: bool = False,
        description: str = "",
    ) -> ParamSpec:
        return ParamSpec(
            type="int",
            default=default,
            minimum=minimum,
            maximum=maximum,
            required=required,
            description=description,
        )

    @staticmethod
    def float(
        default: float | None = None,
        *,
        minimum: float | None = None,
        maximum: float | None = None,
        required: bool = False,
        description: str = "",
    ) -> ParamSpec:
        return ParamSpec(
            type="float",
            default=default,
            minimum=minimum,
            maximum=maximum,
            required=required,
            description=description,
        )

    @staticmethod
    def str(
        default: str | None = None,
        *,
        required: bool = False,
        max_length: int | None = None,
        choices: list | None = None,
        description: str = "",
    ) -> ParamSpec:
        return ParamSpec(
            type="str",
            default=default,
            required=required,
            max_length=max_length,
            choices=choices,
            description=description,
        )

    @staticmethod
    def bool(default: bool = False, *, description: str = "") -> ParamSpec:
        return ParamSpec(type="bool", default=default, description=description)

    @staticmethod
    def image(*, required: bool = True, description: str = "") -> ParamSpec:
        """A picture sent with the request as base64 (a ControlNet's control image)."""
        return ParamSpec(type="image", required=required, description=description)

    @staticmethod
    def lora(description: str = "") -> ParamSpec:
        """The name of a registered LoRA adapter; ``""`` (the default) means none."""
        return ParamSpec(type="lora", default="", description=description)
