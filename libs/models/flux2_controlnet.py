"""The Flux.2 Klein ControlNet ModelFns: there are none.

diffusers 0.42.1 has no ControlNet pipeline for Flux.2 Klein (``diffusers/pipelines/flux2/`` holds
``Flux2Pipeline``, ``Flux2KleinPipeline``, ``Flux2KleinInpaintPipeline`` and the KV-cache variant, and
no Flux.2 ControlNet model), so there is nothing to mirror and the family has no ``-controlnet``
workflows. The module exists because every family is the same four modules
(:mod:`libs.models.families`); a Klein ControlNet's nodes would go here, beside
:mod:`libs.models.flux2`'s.
"""

from __future__ import annotations
