"""The engine guard's command line: flags, environment, the engine's command after --."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.guard.app import run
from controller.guard.settings import load, split_command
from driver.errors import ConfigError


def test_the_engine_command_comes_after_the_double_dash() -> None:
    flags, command = split_command(["--port", "8000", "--", "vllm", "serve", "m", "--",
                                    "x"])
    assert flags == ["--port", "8000"]
    assert command == ["vllm", "serve", "m", "--", "x"]
    assert split_command(["--port", "1"]) == (["--port", "1"], [])


def test_flags_win_over_the_environment(tmp_path: Path) -> None:
    token = tmp_path / "token"
    env = {"ROTA_GUARD_CONTROL_TOKEN_FILE": str(token), "ROTA_GUARD_PORT": "9000",
           "ROTA_GUARD_UPSTREAM": "http://127.0.0.1:9001"}
    settings = load(["--port", "9100"], env)
    assert (settings.port, settings.upstream, settings.control_token_file) == (
        9100, "http://127.0.0.1:9001", token)
    assert settings.upstream_on_loopback
    assert not load(["--upstream", "http://10.0.0.5:8001"], env).upstream_on_loopback


@pytest.mark.parametrize("argv", [
    [],  # the control token file is required
    ["--control-token-file", "t", "--upstream", "https://127.0.0.1:8001"],
    ["--control-token-file", "t", "--upstream", "http://127.0.0.1:8001/v1"],
    ["--control-token-file", "t", "--max-body-bytes", "0"],
])
def test_bad_settings_are_refused(argv: list[str]) -> None:
    with pytest.raises(ConfigError):
        load(argv, {})


async def test_a_missing_or_empty_token_file_stops_the_guard(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="nope"):
        await run(load(["--control-token-file", str(tmp_path / "nope"), "--port", "0"], {}))
    empty = tmp_path / "empty"
    empty.write_text("\n# a comment\n")
    with pytest.raises(OSError, match="no credential"):
        await run(load(["--control-token-file", str(empty), "--port", "0"], {}))
