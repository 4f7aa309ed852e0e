"""Service settings from environment variables: defaults, types, and typos that fail loudly."""

from __future__ import annotations

import pytest

from libs.common.config import ConfigError, load_config
from libs.common.settings import common_settings
from services.executor.config import ExecutorConfig
from services.gateway.auth import ApiKeys
from services.gateway.config import GatewayConfig


def test_settings_come_from_prefixed_variables_with_types_converted():
    cfg = load_config(
        GatewayConfig, "T2I_GATEWAY_", {"T2I_GATEWAY_PORT": "9001", "T2I_GATEWAY_MAX_N": "2", "OTHER": "x"}
    )
    assert cfg.port == 9001 and cfg.max_n == 2 and cfg.host == "127.0.0.1"


def test_a_misspelt_setting_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="unknown setting T2I_EXECUTOR_THREAD;"):
        load_config(ExecutorConfig, "T2I_EXECUTOR_", {"T2I_EXECUTOR_THREAD": "2"})
    with pytest.raises(ConfigError, match="T2I_GATEWAY_"):
        load_config(GatewayConfig, "T2I_GATEWAY_", {"T2I_GATEWAY_PORT": "eighty"})


def test_a_bad_namespace_is_refused():
    with pytest.raises(ConfigError, match="namespace"):
        common_settings({"T2I_NAMESPACE": "Has Spaces"})


def test_api_keys_map_to_tenants_and_roles_from_env_and_file(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text('{"sk-file": {"tenant": "bob"}}')
    keys = ApiKeys.load("sk-a=alice, sk-o=ops:admin", str(f))
    assert keys.lookup("sk-a").tenant == "alice" and not keys.lookup("sk-a").admin
    assert keys.lookup("sk-o").admin and keys.lookup("sk-file").tenant == "bob"
    assert keys.lookup("sk-nope") is None
    for bad in ("sk-a", "sk-a=al ice", "sk-a=alice:root"):
        with pytest.raises(ValueError):
            ApiKeys.load(bad)
