"""The sampling settings of a trained shapes pipeline, measured: ``python -m libs.trained.sweep DIR``.

For each (steps, scheduler shift) of the grid, the pipeline at ``DIR`` draws every held-out caption
(:data:`libs.trained.shapes.HELD_OUT`) for ``--seeds`` seeds, and the evaluator scores them; prints
one JSON line per setting (accuracy per attribute and overall). The shift is the
``FlowMatchEulerDiscreteScheduler``'s (no dynamic shifting), as the ``flux.*`` ModelFns read it
from the folder's ``scheduler_config.json``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

from libs.trained import model, shapes, train


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    from diffusers import FluxPipeline

    ap = argparse.ArgumentParser(prog="python -m libs.trained.sweep", description=__doc__)
    ap.add_argument("model", help="a trained pipeline folder")
    ap.add_argument("--steps", default="8,12,20")
    ap.add_argument("--shifts", default="1.0,3.0")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    pipe = FluxPipeline.from_pretrained(args.model)
    held = [s.caption for s in shapes.HELD_OUT]
    for shift in (float(s) for s in args.shifts.split(",")):
        pipe.scheduler = model.scheduler(shift)
        for steps in (int(s) for s in args.steps.split(",")):
            t0 = time.monotonic()
            acc = train.model_accuracy(pipe, held, range(args.seeds), steps)
            row = {"shift": shift, "steps": steps, "images": len(held) * args.seeds, **acc}
            print(json.dumps({**row, "seconds": round(time.monotonic() - t0, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
