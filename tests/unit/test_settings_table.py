"""The README's settings table is generated from the settings structs (libs/launcher/settings_table.py):
it is not stale, every setting of every service is in it, and every one has a description."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from libs.launcher import settings_table

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_readme_table_is_what_the_structs_generate():
    text = README.read_text()
    assert settings_table.splice(text, settings_table.render()) == text, (
        "stale: python -m libs.launcher.settings_table --write README.md"
    )
    assert settings_table.main(["--check", str(README)]) == 0


def test_every_setting_is_in_the_table_with_a_description():
    assert settings_table.undocumented() == []
    table = settings_table.render()
    for prefix, cls in settings_table.sources():
        for f in msgspec.structs.fields(cls):
            var = prefix + f.name.upper()
            short = "_" + f.name.upper()
            assert f"`{var}`" in table or f"`{short}`" in table, var


def test_a_readme_without_the_markers_is_refused(tmp_path):
    with pytest.raises(ValueError, match="marker"):
        settings_table.splice("# no table here\n", "| x |")
    stale = tmp_path / "README.md"
    stale.write_text(f"a\n{settings_table.BEGIN}\n| old |\n{settings_table.END}\nb\n")
    assert settings_table.main(["--check", str(stale)]) == 1
    assert (
        settings_table.main(["--write", str(stale)]) == 0
        and settings_table.main(["--check", str(stale)]) == 0
    )
    assert stale.read_text().startswith("a\n") and stale.read_text().endswith("b\n")
