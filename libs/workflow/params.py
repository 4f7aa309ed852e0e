"""Checking a request's workflow parameters against the spec and filling in defaults."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from libs.workflow.errors import ParamError
from libs.workflow.spec import ParamSpec, Scalar, WorkflowSpec

_TYPE_WORDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "a boolean",
    "image": "an image",
    "lora": "a LoRA name",
}


def check_param(name: str, p: ParamSpec, value: Any) -> Scalar:
    """Return ``value`` as the parameter's type, or raise ParamError naming the parameter."""
    if p.type == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif p.type == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok:
            value = float(value)
            if value != value or value in (float("inf"), float("-inf")):
                raise ParamError(name, "must be a finite number")
    elif p.type in ("str", "image", "lora"):
        ok = isinstance(value, str)  # images: an object reference by now; LoRAs: a name or path
    else:
        ok = isinstance(value, bool)
    if not ok:
        raise ParamError(name, f"must be {_TYPE_WORDS[p.type]}, got {type(value).__name__}")
    if p.minimum is not None and value < p.minimum:
        raise ParamError(name, f"must be at least {_num(p.minimum)}, got {value}")
    if p.maximum is not None and value > p.maximum:
        raise ParamError(name, f"must be at most {_num(p.maximum)}, got {value}")
    if p.choices is not None and value not in p.choices:
        raise ParamError(name, f"must be one of {p.choices}, got {value!r}")
    if p.max_length is not None and isinstance(value, str) and len(value) > p.max_length:
        raise ParamError(name, f"must be at most {p.max_length} characters, got {len(value)}")
    return value


def resolve_params(spec: WorkflowSpec, given: Mapping[str, Any]) -> dict[str, Scalar]:
    """Validate ``given`` against ``spec.params``; return every parameter with defaults filled."""
    for name in given:
        if name not in spec.params:
            known = ", ".join(sorted(spec.params)) or "none"
            raise ParamError(name, f"not a parameter of workflow {spec.name!r} (parameters: {known})")
    out: dict[str, Scalar] = {}
    for name, p in spec.params.items():
        if name in given:
            out[name] = check_param(name, p, given[name])
        elif p.required:
            raise ParamError(name, "is required")
        else:
            # An optional picture or adapter left out is "" (none), which checks again as given.
            out[name] = "" if p.type in ("lora", "image") and p.default is None else p.default
    return out


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
