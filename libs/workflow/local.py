"""Running a workflow in this process, node by node: the reference for decomposition tests.

:class:`LocalRunner` unrolls a spec for one request and calls each node's ModelFn in topological
order, passing outputs straight to consumers (no bus, no data plane) and callback inputs as
:class:`~libs.workflow.modelfn.Deferred`. It is what "the decomposed workflow" means in tests that
compare against a monolithic diffusers pipeline; the executors run the same ModelFn code with the
same inputs, moved through the data plane instead.

Image parameters name pictures in ``images`` (``PIL.Image``); LoRA parameters name adapters in
``loras`` (name -> safetensors path), as the platform's LoRA registry does.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from libs.protocol.ids import ModelKey
from libs.workflow import catalog
from libs.workflow.dag import Const, DagNode, ImageSource, LoraSource, TensorSource, unroll
from libs.workflow.errors import ParamError
from libs.workflow.modelfn import Deferred, ModelFn
from libs.workflow.params import resolve_params
from libs.workflow.paths import resolve_model_path
from libs.workflow.spec import WorkflowSpec, walk
from libs.workflow.validate import validate_spec


class LocalRunner:
    """Keeps ModelFn instances and loaded components across runs, as an executor would; models load
    onto ``device`` (``ModelFn.load_model(model_path, device)``)."""

    def __init__(
        self,
        model_root: Path | str,
        classes: Mapping[str, type[ModelFn]] | None = None,
        device: str = "cpu",
        models: Any = None,
    ) -> None:
        """``models``: an executor's model cache (``acquire(fn, model)`` -> a hold with
        ``.components``, ``release(hold)``), so the workflow runs over its weight cache; by default
        the runner loads every model whole, once."""
        self.models = models
        self.model_root = Path(model_root)
        self.classes = dict(classes or {})
        self.device = device
        self._instances: dict[str, ModelFn] = {}
        self._components: dict[ModelKey, dict[str, Any]] = {}

    def _class(self, fn: str) -> type[ModelFn]:
        if fn not in self.classes:
            self.classes[fn] = catalog.load_class(fn)
        return self.classes[fn]

    def run(
        self,
        spec: WorkflowSpec,
        params: Mapping[str, Any],
        *,
        images: Mapping[str, Any] | None = None,
        loras: Mapping[str, str] | None = None,
        on_node: Callable[[DagNode], None] | None = None,
    ) -> dict[str, Any]:
        import torch

        fns = {op.fn for _, op, _ in walk(spec.body) if hasattr(op, "fn")}
        sigs = {fn: self._class(fn).signature() for fn in fns}
        spec = validate_spec(spec, sigs)
        resolved = resolve_params(spec, params)
        for name, p in spec.params.items():
            if p.type == "lora" and resolved[name]:
                if resolved[name] not in (loras or {}):
                    raise ParamError(name, f"unknown LoRA {resolved[name]!r}")
                resolved[name] = resolve_model_path(loras[resolved[name]], self.model_root)  # type: ignore[index]
        callbacks = {fn: frozenset(n for n, cb in s.inputs.items() if cb) for fn, s in sigs.items()}
        dag = unroll(
            spec, resolved, callbacks=callbacks, outputs_of={fn: tuple(s.outputs) for fn, s in sigs.items()}
        )
        values: dict[TensorSource, Any] = {}
        for node in dag.nodes.values():
            inst = self._instances.get(node.fn)
            if inst is None:
                inst = self._instances[node.fn] = self._class(node.fn)()
            key = ModelKey(node.fn, node.model)
            if self.models is None and key not in self._components:
                path = resolve_model_path(node.model, self.model_root)
                self._components[key] = inst.load_model(path, self.device)
            kwargs: dict[str, Any] = {}
            for name, src in node.inputs.items():
                if isinstance(src, Const):
                    kwargs[name] = src.value
                elif isinstance(src, LoraSource):
                    kwargs[name] = src.path
                elif isinstance(src, ImageSource):
                    if src.ref not in (images or {}):
                        raise ParamError(name, f"no image {src.ref!r}")
                    kwargs[name] = images[src.ref]  # type: ignore[index]
                elif name in node.callbacks:
                    kwargs[name] = Deferred(name, lambda src=src: values[src])
                else:
                    kwargs[name] = values[src]
            if on_node is not None:
                on_node(node)
            if self.models is None:
                with torch.no_grad():
                    outs = inst.execute(self._components[key], **kwargs)
            else:
                held = self.models.acquire(node.fn, node.model)
                try:
                    with torch.no_grad():
                        outs = inst.execute(held.components, **kwargs)
                finally:
                    self.models.release(held)
            for out in node.outputs:
                values[TensorSource(node.id, out)] = outs[out]
        return {name: values[src] for name, src in dag.outputs.items()}
