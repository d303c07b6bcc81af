"""A published placeholder is never a credential: the components refuse one at start, and
the chart never renders one."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.credentials import SecretFile

PLACEHOLDER = "change-me-before-applying"  # what the hand-written manifests once shipped


async def test_a_placeholder_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"{PLACEHOLDER}\n")
    with pytest.raises(OSError, match="placeholder"):
        await SecretFile(path).load()


async def test_a_placeholder_next_to_a_real_token_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"3f1c9a0d8e7b6a5f4e3d2c1b0a998877\n{PLACEHOLDER}\n")
    with pytest.raises(OSError, match="placeholder"):
        await SecretFile(path).load()


async def test_a_reload_onto_a_placeholder_keeps_the_last_good_value(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("3f1c9a0d8e7b6a5f4e3d2c1b0a998877\n")
    secret = SecretFile(path)
    await secret.load()
    path.write_text(f"{PLACEHOLDER}\n")
    with pytest.raises(OSError, match="placeholder"):
        await secret.load()
    assert secret.lines == ("3f1c9a0d8e7b6a5f4e3d2c1b0a998877",)


async def test_a_random_token_is_accepted(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("# rotated 2026-12-01\n3f1c9a0d8e7b6a5f4e3d2c1b0a998877\n")
    secret = SecretFile(path)
    await secret.load()
    assert secret.lines == ("3f1c9a0d8e7b6a5f4e3d2c1b0a998877",)


async def test_the_gateway_does_not_start_with_a_placeholder(tmp_path: Path) -> None:
    from controller.gateway.app import StartupError, _secrets

    path = tmp_path / "token"
    path.write_text(f"{PLACEHOLDER}\n")
    lifecycle = _secrets(SecretFile(path), None, 30.0)
    with pytest.raises(StartupError, match="placeholder"):
        await anext(aiter(lifecycle(None)))  # type: ignore[arg-type]
