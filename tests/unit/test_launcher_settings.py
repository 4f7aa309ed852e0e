"""The launcher's own settings (``libs/launcher/settings.py``) are read from their variables only."""

from __future__ import annotations

from libs.launcher.settings import LauncherSettings, launcher_settings


def test_the_launcher_reads_its_settings_and_leaves_the_services_ones_alone():
    env = {"T2I_VAR": "/srv/t2i", "T2I_WORKFLOWS": "a=sd:m b=flux:n", "T2I_GATEWAY_PORT": "1", "HOME": "/"}
    assert launcher_settings(env) == LauncherSettings(var="/srv/t2i", workflows="a=sd:m b=flux:n")
    assert launcher_settings({}) == LauncherSettings(var="var", workflows="")
