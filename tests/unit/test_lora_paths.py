"""A tenant's LoRA names a file under the executors' model root, nothing else: the registry refuses
absolute and `..` paths, and an executor refuses any path that resolves outside the root, symlinks
included (a LoRA path must not be an oracle for, or a reader of, the executor's files)."""

from __future__ import annotations

from pathlib import Path

import pytest

from libs.protocol.messages import LoraInfo
from libs.workflow.paths import resolve_lora_path
from services.registry.service import check_lora


@pytest.mark.parametrize(
    "path",
    [
        "/etc/passwd.safetensors",
        "~/x.safetensors",
        "../x.safetensors",
        "a/../../x.safetensors",
        "C:/x.safetensors",
    ],
)
def test_the_registry_refuses_a_lora_path_outside_the_model_root(path: str) -> None:
    problems = check_lora(LoraInfo(name="style", path=path))
    assert [p.path for p in problems] == ["path"], problems


def test_the_registry_accepts_a_relative_path() -> None:
    assert check_lora(LoraInfo(name="style", path="loras/style.safetensors")) == []


def test_an_executor_resolves_a_lora_under_its_root_and_refuses_escapes(tmp_path: Path) -> None:
    root = tmp_path / "models"
    (root / "loras").mkdir(parents=True)
    (root / "loras" / "style.safetensors").write_bytes(b"x")
    (tmp_path / "secret.safetensors").write_bytes(b"s")
    (root / "loras" / "link.safetensors").symlink_to(tmp_path / "secret.safetensors")

    assert resolve_lora_path("loras/style.safetensors", root) == str(
        (root / "loras" / "style.safetensors").resolve()
    )
    for bad in ("/etc/passwd", "../secret.safetensors", "loras/link.safetensors", "~/x.safetensors"):
        with pytest.raises(ValueError, match="model root"):
            resolve_lora_path(bad, root)
