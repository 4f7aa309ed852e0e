"""A small HTTP client for the gateway (standard library only)."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from typing import Any

from libs.workflow.compose import Workflow
from libs.workflow.spec import WorkflowSpec, encode_spec


class SDKError(RuntimeError):
    """The gateway refused a call: ``status``, the offending ``param`` and, for specs, ``problems``."""

    def __init__(
        self, status: int, message: str, param: str | None = None, problems: list | None = None
    ) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.param = param
        self.problems = problems or []


class Client:
    def __init__(self, base_url: str, api_key: str, timeout: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _call(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.api_key}")
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read() or b"{}")
        except urllib.error.HTTPError as e:
            try:
                err = json.loads(e.read()).get("error", {})
            except (json.JSONDecodeError, AttributeError):
                err = {}
            raise SDKError(
                e.code, err.get("message", e.reason), err.get("param"), err.get("problems")
            ) from None

    def register(self, workflow: Workflow | WorkflowSpec) -> dict[str, Any]:
        """Register (or re-register) a workflow; returns the stored spec with its version."""
        spec = workflow.spec() if isinstance(workflow, Workflow) else workflow
        return self._call("POST", "/v1/workflows", json.loads(encode_spec(spec)))

    def register_lora(self, name: str, path: str, description: str = "") -> dict[str, Any]:
        return self._call("POST", "/v1/loras", {"name": name, "path": path, "description": description})

    def workflows(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/workflows")["data"]

    def generate(
        self,
        model: str,
        prompt: str,
        *,
        n: int = 1,
        size: str | None = None,
        seed: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        params: dict[str, Any] | None = None,
        images: dict[str, bytes] | None = None,
    ) -> list[bytes]:
        """Generate ``n`` images; returns PNG bytes. ``images`` are image parameters (raw bytes)."""
        body: dict[str, Any] = {"model": model, "prompt": prompt, "n": n}
        for key, value in (
            ("size", size),
            ("seed", seed),
            ("num_inference_steps", num_inference_steps),
            ("guidance_scale", guidance_scale),
        ):
            if value is not None:
                body[key] = value
        extra = dict(params or {})
        for key, raw in (images or {}).items():
            extra[key] = base64.b64encode(raw).decode()
        if extra:
            body["params"] = extra
        out = self._call("POST", "/v1/images/generations", body)
        return [base64.b64decode(item["b64_json"]) for item in out["data"]]


def register(workflow: Workflow | WorkflowSpec, *, base_url: str, api_key: str) -> dict[str, Any]:
    return Client(base_url, api_key).register(workflow)


def register_lora(
    name: str, path: str, *, base_url: str, api_key: str, description: str = ""
) -> dict[str, Any]:
    return Client(base_url, api_key).register_lora(name, path, description)


def generate(model: str, prompt: str, *, base_url: str, api_key: str, **kwargs: Any) -> list[bytes]:
    return Client(base_url, api_key).generate(model, prompt, **kwargs)
