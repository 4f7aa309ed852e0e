"""tiny-flux with the example plugin's post-processing node on its image (``example.invert``, from
``tests/plugins/t2i_example``): a workflow that needs a ModelFn installed only as a user's package."""

from __future__ import annotations

from typing import Any

PLUGIN = "example.invert"


def inverted_flux() -> Any:
    """The SDK workflow ``inverted-flux``: tiny-flux at 64x64, 2 steps, its image inverted."""
    from libs.models.flux import (
        FlowMatchEulerStep,
        FluxClipEncoder,
        FluxPrepareLatents,
        FluxT5Encoder,
        FluxTransformer,
        FluxVaeDecode,
    )
    from libs.models.flux_workflows import flux_params
    from libs.sdk import Workflow
    from libs.workflow import catalog

    m = "tiny-flux"
    clip, t5, prep, flux = FluxClipEncoder(m), FluxT5Encoder(m), FluxPrepareLatents(m), FluxTransformer(m)
    euler, vae, invert = FlowMatchEulerStep(m), FluxVaeDecode(m), catalog.load_class(PLUGIN)()
    with Workflow(
        "inverted-flux",
        params=flux_params(width=64, height=64, steps=2, max_sequence_length=64),
        sizes=["64x64"],
    ) as wf:
        clip()
        t5()
        init = prep()
        latents = wf.loop(
            "num_inference_steps",
            lambda step, latents: euler(noise_pred=flux(latents=latents).noise_pred, latents=latents),
            latents=init.latents,
        )
        wf.output("image", invert(image=vae(latents=latents)))
    return wf
