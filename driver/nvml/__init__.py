"""The GPU access layer: one NVML Protocol, a pynvml implementation and a fake.

Importing this package loads neither pynvml nor pydantic; import
:mod:`driver.nvml.real` or :mod:`driver.nvml.fake` for an implementation. The fixtures
shipped with the package (``fixtures/<name>.json``) describe real or realistic GPU nodes
for the fake.
"""

from __future__ import annotations

from pathlib import Path

from driver.nvml.api import (
    HealthEvent,
    HealthEventKind,
    MemoryInfo,
    NvmlBackend,
    ProcessInfo,
)
from rota.kit.errors import ConfigError

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"


def fixture_path(name: str) -> Path:
    """The path of a shipped fixture: ``h200`` (recorded) or ``h200x8`` (eight GPUs)."""
    path = FIXTURES_DIR / f"{name}.json"
    if "/" in name or not path.is_file():
        known = sorted(p.stem for p in FIXTURES_DIR.glob("*.json"))
        raise ConfigError(f"no NVML fixture named {name!r}; shipped: {known}")
    return path


def open_backend(fake_fixture: str | Path | None, proc_dir: Path | None) -> NvmlBackend:
    """The real NVML backend, or the fake one when ``fake_fixture`` is given: a file, or
    the name of a shipped fixture (``h200``); ``proc_dir`` is the fake's process registry.
    Neither implementation is imported unless it is used."""
    if fake_fixture is None:
        from driver.nvml.real import PynvmlBackend

        return PynvmlBackend()
    from driver.nvml.fake import FakeNvml

    path = Path(fake_fixture)
    if "/" not in str(fake_fixture) and not path.is_file():
        path = fixture_path(str(fake_fixture))
    return FakeNvml.from_path(path, proc_dir)


__all__ = [
    "FIXTURES_DIR",
    "HealthEvent",
    "HealthEventKind",
    "MemoryInfo",
    "NvmlBackend",
    "ProcessInfo",
    "fixture_path",
    "open_backend",
]
