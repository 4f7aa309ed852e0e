"""Registry settings (``T2I_REGISTRY_*``); it also reads the common ``T2I_*`` settings."""

from __future__ import annotations

import msgspec


class RegistryConfig(msgspec.Struct, forbid_unknown_fields=True):
    pass  # nothing registry-specific yet; the store and subjects come from the common settings
