"""Settings: every field a flag and a ROTA_GATEWAY_ variable; flags win; errors are clear."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.gateway.__main__ import main
from controller.gateway.settings import GatewaySettings, SettingsError, env_name, load

pytestmark = pytest.mark.gateway


def test_environment_then_flags() -> None:
    env = {"ROTA_GATEWAY_PORT": "9000", "ROTA_GATEWAY_MAX_CONCURRENCY_PER_ENGINE": "3",
           "ROTA_GATEWAY_API_KEYS_FILE": "/run/keys/keys"}
    settings = load(["--port", "9100"], env)
    assert settings.port == 9100
    assert settings.max_concurrency_per_engine == 3
    assert settings.api_keys_file == Path("/run/keys/keys")
    assert load([], {}) == GatewaySettings()


def test_invalid_values_name_the_field() -> None:
    with pytest.raises(SettingsError, match="queue_size"):
        load(["--queue-size", "-1"], {})


def test_help_lists_every_field_with_its_variable(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for name in GatewaySettings.model_fields:
        assert f"--{name.replace('_', '-')}" in text
        assert env_name(name) in text


def test_bad_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--max-body-bytes", "10"]) == 2
    assert "max_body_bytes" in capsys.readouterr().err
