"""Build random-weight model folders (no hub needed).

``python -m libs.models.build --out models --all``: every catalog family (SD1.5, SD3, Flux dev and
schnell, Sana) with its ControlNet and LoRA adapter, under ``models/``.
``python -m libs.models.build --out models [--preset tiny|bench] [--name N]``: one Flux folder
(``tiny-flux`` or ``bench-flux`` by default). Idempotent: complete folders are left alone.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

DEFAULT_NAMES = {"tiny": "tiny-flux", "bench": "bench-flux"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libs.models.build", description=__doc__)
    parser.add_argument("--out", required=True, help="folder that holds model folders, e.g. models")
    parser.add_argument("--all", action="store_true", help="every catalog family, ControlNet and LoRA")
    parser.add_argument("--preset", choices=("tiny", "bench"), default="tiny")
    parser.add_argument("--name", default=None, help="model folder name (default: <preset>-flux)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    if args.all:
        from libs.models.families import build

        for name, path in sorted(build(args.out).items()):
            print(f"{name}: {path}")
        return 0
    from libs.models.tiny_flux import build_flux

    name = args.name or DEFAULT_NAMES[args.preset]
    print(build_flux(f"{args.out}/{name}", preset=args.preset, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
