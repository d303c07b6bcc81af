"""The engine guard's command line: flags, environment, the engine's command after --."""

from __future__ import annotations

import pytest

from controller.guard.app import run
from controller.guard.settings import load, split_command
from rota.kit.errors import ConfigError


def test_the_engine_command_comes_after_the_double_dash() -> None:
    flags, command = split_command(["--port", "8000", "--", "vllm", "serve", "m", "--",
                                    "x"])
    assert flags == ["--port", "8000"]
    assert command == ["vllm", "serve", "m", "--", "x"]
    assert split_command(["--port", "1"]) == (["--port", "1"], [])


def test_flags_win_over_the_environment() -> None:
    env = {"ROTA_GUARD_PORT": "9000", "ROTA_GUARD_UPSTREAM": "http://127.0.0.1:9001"}
    settings = load(["--port", "9100"], env)
    assert (settings.port, settings.upstream) == (9100, "http://127.0.0.1:9001")
    assert settings.upstream_on_loopback
    assert not load(["--upstream", "http://10.0.0.5:8001"], env).upstream_on_loopback


@pytest.mark.parametrize("argv", [
    ["--upstream", "https://127.0.0.1:8001"],
    ["--upstream", "http://127.0.0.1:8001/v1"],
    ["--max-body-bytes", "0"],
])
def test_bad_settings_are_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        load(argv, {})


async def test_without_the_claims_control_token_the_guard_does_not_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ROTA_CONTROL_TOKEN", raising=False)
    with pytest.raises(OSError, match="ROTA_CONTROL_TOKEN is not set"):
        await run(load(["--port", "0"], {}))
    monkeypatch.setenv("ROTA_CONTROL_TOKEN", "change-me")
    with pytest.raises(OSError, match="placeholder"):
        await run(load(["--port", "0"], {}))
