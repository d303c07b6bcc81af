"""Fixtures of the chart's tests: helm and promtool (built once, cached), and a Helm
environment that writes nothing outside the test's directories."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from e2e.release.chart import tools_bin


@pytest.fixture(scope="session")
def chart_bin() -> Path:
    """The directory of helm and promtool (``ROTA_CHART_TOOLS_BIN`` or the build cache)."""
    return tools_bin()


@pytest.fixture(scope="session")
def helm_home() -> Iterator[dict[str, str]]:
    """HELM_*_HOME under a temporary directory: helm's caches and config stay there."""
    with tempfile.TemporaryDirectory(prefix="rota-helm-") as root:
        yield {f"HELM_{kind}_HOME": str(Path(root) / kind.lower())
               for kind in ("CACHE", "CONFIG", "DATA")}
