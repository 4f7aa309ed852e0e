"""Build a random-weight model folder: ``python -m libs.models.build --out models [--preset tiny|bench]``.

Builds ``<out>/<name>`` (default name ``tiny-flux`` or ``bench-flux``) with
:func:`libs.models.tiny.build_flux`; idempotent (a complete folder is left alone). Prints the path.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from libs.models.tiny import PRESETS, build_flux

DEFAULT_NAMES = {"tiny": "tiny-flux", "bench": "bench-flux"}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libs.models.build", description=__doc__)
    parser.add_argument("--out", required=True, help="folder that holds model folders, e.g. models")
    parser.add_argument("--preset", choices=PRESETS, default="tiny")
    parser.add_argument("--name", default=None, help="model folder name (default: <preset>-flux)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    args = parser.parse_args(argv)
    name = args.name or DEFAULT_NAMES[args.preset]
    print(build_flux(f"{args.out}/{name}", preset=args.preset, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
