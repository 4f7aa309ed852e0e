"""What a workflow can be asked to do, read from its parameters: the one place that decides it.

* ``edit``: it has an ``image`` parameter of type image (the picture ``POST /v1/images/edits``
  uploads); further pictures fill ``image_2``, ``image_3``, … when it has them.
* ``inpaint``: it can edit and has a ``mask`` parameter of type image (white repaints).
* ``generate``: it runs from a prompt alone, without a picture to edit (its ``image`` parameter,
  if any, is optional). A ControlNet's control image is a parameter of another name: such a
  workflow generates.

``GET /v1/models`` lists them per model (``capabilities``); the edits route refuses a workflow
that cannot edit (or inpaint, when a mask is given) with a 400 naming it.
"""

from __future__ import annotations

from libs.protocol.messages import WorkflowSummary
from libs.workflow.spec import WorkflowSpec

MAX_IMAGES = 4  # pictures one edit may upload: ``image`` and up to ``image_4``
CAPABILITIES = ("generate", "edit", "inpaint")


def image_params(spec: WorkflowSpec) -> list[str]:
    """The parameters uploaded pictures fill, in order: ``image``, ``image_2``, ``image_3``, …"""
    names = []
    for i in range(1, MAX_IMAGES + 1):
        name = "image" if i == 1 else f"image_{i}"
        p = spec.params.get(name)
        if p is None or p.type != "image":
            break
        names.append(name)
    return names


def capabilities(spec: WorkflowSpec) -> list[str]:
    """What ``spec`` can do, in the order of :data:`CAPABILITIES`."""
    image = spec.params.get("image")
    edits = bool(image_params(spec))
    mask = spec.params.get("mask")
    out = []
    if not (edits and image is not None and image.required and image.default is None):
        out.append("generate")
    if edits:
        out.append("edit")
        if mask is not None and mask.type == "image":
            out.append("inpaint")
    return out


def summary(spec: WorkflowSpec) -> WorkflowSummary:
    """The registry's listing entry of ``spec`` (and the gateway's model object's source)."""
    return WorkflowSummary(
        name=spec.name,
        version=spec.version,
        description=spec.description,
        params=sorted(spec.params),
        sizes=list(spec.sizes),
        capabilities=capabilities(spec),
    )
