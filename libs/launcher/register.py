"""``python -m libs.launcher.register``: register the workflow catalog with a running registry.

The init job of ``deploy/compose.yaml`` (docs/deploy.md): after ``up`` the gateway serves the
catalog with no further step. It registers, straight to the registry over NATS (no API key
needed; as the NATS admin user in compose):

* the catalog (``libs.models.families``: every family's workflows on the models ``model-init``
  builds, and their LoRA adapters), unless ``--no-catalog``;
* one basic workflow per ``--workflow`` / ``T2I_WORKFLOWS`` entry, on a model the operator names —
  a Hub id (executors download it into the mounted Hugging Face cache with ``HF_TOKEN``), a folder
  under the model volume, or the absolute path of a mounted diffusers folder::

      NAME=FAMILY:MODEL[?size=WxH&steps=N&msl=N&guidance=G]
      flux-schnell=flux:black-forest-labs/FLUX.1-schnell?size=1024x1024&steps=4&guidance=0

  entries separated by spaces or ``;``; FAMILY is one of flux, sd, sd3, sana, flux2 (Flux.2 Klein;
  its defaults are ``Flux2KleinPipeline``'s, so a step-distilled checkpoint wants ``steps=4``),
  zimage (Z-Image; ``ZImagePipeline``'s defaults, base Z-Image's: Turbo wants
  ``steps=8&guidance=0``), qwenimage (``QwenImagePipeline``'s defaults, true CFG at 4);
* every ``*.json`` spec in ``--specs DIR`` (what ``libs.sdk`` / ``t2i register`` send).

Registering is idempotent (an unchanged spec keeps its version), so it runs at every ``up``. It
waits for the registry up to ``--wait-s`` seconds, and exits non-zero naming any spec refused.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qs

ENTRY = re.compile(r"^(?P<name>[^=\s]+)=(?P<family>[a-z0-9]+):(?P<model>[^?\s]+)(?:\?(?P<query>\S*))?$")
#: Per family: (default size, default steps, default max sequence length).
DEFAULTS = {
    "flux": ("1024x1024", 28, 256),
    "sd": ("512x512", 30, 0),
    "sd3": ("1024x1024", 28, 256),
    "sana": ("1024x1024", 20, 300),
    "flux2": ("1024x1024", 50, 512),
    "zimage": ("1024x1024", 50, 512),
    "qwenimage": ("1024x1024", 50, 512),
}


class EntryError(ValueError):
    pass


@dataclass(frozen=True)
class Entry:
    name: str
    family: str
    model: str
    size: str
    steps: int
    max_sequence_length: int
    guidance: float | None = None

    def spec(self):
        """The family's basic text-to-image workflow on ``model``."""
        from libs.models import flux2_workflows, flux_workflows, sana_workflows, sd3_workflows, sd_workflows

        kw: dict = {
            "sizes": [self.size],
            "steps": self.steps,
            "description": f"{self.family} on {self.model}",
        }
        if self.family == "flux":
            if self.guidance is not None:
                kw["guidance_scale"] = self.guidance
            return flux_workflows.flux_workflow(
                self.name, self.model, max_sequence_length=self.max_sequence_length, **kw
            )
        if self.family == "flux2":
            if self.guidance is not None:
                kw["guidance_scale"] = self.guidance
            return flux2_workflows.flux2_workflow(
                self.name, self.model, max_sequence_length=self.max_sequence_length, **kw
            )
        if self.family == "zimage":
            from libs.models import zimage_workflows

            if self.guidance is not None:
                kw["guidance_scale"] = self.guidance
            return zimage_workflows.zimage_workflow(
                self.name, self.model, max_sequence_length=self.max_sequence_length, **kw
            )
        if self.guidance is not None:
            raise EntryError(f"{self.name}: guidance= applies to flux, flux2 and zimage workflows only")
        if self.family == "sd":
            return sd_workflows.sd_workflow(self.name, self.model, **kw)
        if self.family == "qwenimage":
            from libs.models import qwenimage_workflows

            return qwenimage_workflows.qwenimage_workflow(
                self.name, self.model, max_sequence_length=self.max_sequence_length, **kw
            )
        if self.family == "sd3":
            return sd3_workflows.sd3_workflow(
                self.name, self.model, max_sequence_length=self.max_sequence_length, **kw
            )
        return sana_workflows.sana_workflow(
            self.name, self.model, max_sequence_length=self.max_sequence_length, **kw
        )


def parse_entries(text: str) -> list[Entry]:
    """``T2I_WORKFLOWS`` / ``--workflow`` entries; raises :class:`EntryError` naming the bad one."""
    from libs.workflow.spec import parse_size
    from libs.workflow.validate import WORKFLOW_NAME

    out: list[Entry] = []
    for raw in (x for x in re.split(r"[\s;]+", text.strip()) if x):
        m = ENTRY.match(raw)
        if not m:
            raise EntryError(f"{raw!r}: expected NAME=FAMILY:MODEL[?size=WxH&steps=N&msl=N&guidance=G]")
        name, family, model = m["name"], m["family"], m["model"]
        if not WORKFLOW_NAME.match(name):
            raise EntryError(f"{raw!r}: the name must match {WORKFLOW_NAME.pattern}")
        if family not in DEFAULTS:
            raise EntryError(f"{raw!r}: unknown family {family!r} (one of {', '.join(DEFAULTS)})")
        if len(model) > 512 or ".." in model.split("/"):
            raise EntryError(f"{raw!r}: the model must be a Hub id, a folder name or an absolute path")
        size, steps, msl = DEFAULTS[family]
        guidance = None
        query = parse_qs(m["query"] or "", keep_blank_values=True, strict_parsing=bool(m["query"]))
        for key, values in query.items():
            value = values[-1]
            try:
                if key == "size":
                    parse_size(value)
                    size = value
                elif key == "steps":
                    steps = int(value)
                    if not 1 <= steps <= 1000:
                        raise ValueError("steps must be within 1..1000")
                elif key == "msl":
                    msl = int(value)
                    if not 1 <= msl <= 4096:
                        raise ValueError("msl must be within 1..4096")
                elif key == "guidance":
                    guidance = float(value)
                else:
                    raise ValueError(f"unknown option {key!r} (size, steps, msl, guidance)")
            except ValueError as e:
                raise EntryError(f"{raw!r}: {e}") from None
        out.append(Entry(name, family, model, size, steps, msl, guidance))
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise EntryError(f"a workflow name is given twice: {names}")
    return out


def catalog_specs() -> tuple[list, dict[str, str]]:
    from libs.models import families

    return families.workflows(), dict(families.LORAS)


async def register_all(
    nats_url: str,
    namespace: str,
    specs: Sequence[tuple[str, bytes]],
    loras: dict[str, str],
    wait_s: float = 120.0,
    say: Callable[[str], None] = print,
) -> list[str]:
    """Register ``specs`` ((label, spec JSON)) and ``loras``; the problems (empty: all stored)."""
    from libs.common.nats_conn import connect
    from libs.common.registry_client import RegistryClient, RegistryUnavailable
    from libs.protocol.messages import LoraInfo
    from libs.protocol.subjects import Subjects

    nc = await connect(nats_url, "register")
    client = RegistryClient(nc, Subjects(namespace), timeout=5.0)
    problems: list[str] = []
    deadline = time.monotonic() + wait_s

    async def call(make):
        while True:
            try:
                return await make()
            except RegistryUnavailable as e:
                if time.monotonic() > deadline:
                    raise SystemExit(f"no registry answered within {wait_s:g} s: {e}") from None
                await asyncio.sleep(1.0)

    try:
        created = 0
        for label, raw in specs:
            reply = await call(lambda raw=raw: client.register(raw))
            if reply.ok:
                created += reply.created
            else:
                problems.append(f"{label}: {reply.error}")
        for name, path in sorted(loras.items()):
            reply = await call(
                lambda name=name, path=path: client.register_lora(LoraInfo(name=name, path=path))
            )
            if not reply.ok:
                problems.append(f"LoRA {name}: {reply.error}")
        stored = len(specs) - sum(1 for p in problems if not p.startswith("LoRA "))
        say(
            f"registered {stored} of {len(specs)} workflows ({created} new or changed) and "
            f"{len(loras)} LoRA adapters in namespace {namespace}"
        )
    finally:
        await nc.close()
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m libs.launcher.register", description=__doc__)
    ap.add_argument("--no-catalog", action="store_true", help="skip the built-in catalog")
    ap.add_argument("--workflow", action="append", default=[], help="NAME=FAMILY:MODEL[?...] (repeatable)")
    ap.add_argument("--specs", type=Path, default=None, help="a folder of spec JSON files to register")
    ap.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for a registry")
    args = ap.parse_args(argv)

    from libs.common.settings import common_settings
    from libs.launcher.settings import launcher_settings
    from libs.workflow.spec import encode_spec

    try:
        entries = parse_entries(" ".join([launcher_settings().workflows, *args.workflow]))
        specs: list[tuple[str, bytes]] = []
        loras: dict[str, str] = {}
        if not args.no_catalog:
            catalog, loras = catalog_specs()
            specs += [(s.name, encode_spec(s)) for s in catalog]
        specs += [(f"{e.name} ({e.family} on {e.model})", encode_spec(e.spec())) for e in entries]
    except EntryError as e:
        print(f"T2I_WORKFLOWS / --workflow: {e}", file=sys.stderr)
        return 2
    if args.specs is not None:
        if not args.specs.is_dir():
            print(f"--specs {args.specs}: not a folder", file=sys.stderr)
            return 2
        specs += [(str(p), p.read_bytes()) for p in sorted(args.specs.glob("*.json"))]
    s = common_settings()
    problems = asyncio.run(register_all(s.nats_url, s.namespace, specs, loras, args.wait_s))
    for p in problems:
        print(f"refused: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
