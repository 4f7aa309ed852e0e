"""Settings of the launcher's own commands (``make run``, ``python -m libs.launcher.brokers``,
``python -m libs.launcher.register``): read here, in one place, like every service's."""

from __future__ import annotations

import os
from collections.abc import Mapping

import msgspec

from libs.common.config import load_config


class LauncherSettings(msgspec.Struct, forbid_unknown_fields=True):
    # Where `make` keeps the NATS and Redis it starts when none is running (their data and logs).
    var: str = "var"
    # Workflows to register besides the catalog, space-separated ``NAME=FAMILY:MODEL[?...]`` entries
    # (docs/deploy.md; the register job's ``--workflow`` adds more).
    workflows: str = ""


NAMES = tuple(f"T2I_{f.upper()}" for f in LauncherSettings.__struct_fields__)


def launcher_settings(env: Mapping[str, str] | None = None) -> LauncherSettings:
    env = os.environ if env is None else env
    return load_config(LauncherSettings, "T2I_", {k: v for k, v in env.items() if k in NAMES})
