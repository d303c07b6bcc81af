"""``manifests/`` has one source, the chart: its files are what ``make manifests`` renders,
byte for byte, and nothing else (``manifests/examples/`` is hand-written)."""

from __future__ import annotations

from pathlib import Path

from e2e.release.chart import MANIFESTS, manifest_files


def test_manifests_are_the_rendered_chart(chart_bin: Path) -> None:
    want = manifest_files(chart_bin)
    have = {p.name: p.read_text() for p in MANIFESTS.glob("*.yaml")}
    assert sorted(have) == sorted(want), "run `make manifests`"
    stale = [name for name in want if have[name] != want[name]]
    assert not stale, f"manifests/ differ from the chart in {stale}: run `make manifests`"


def test_the_rendered_manifests_hold_no_secret_value() -> None:
    for path in MANIFESTS.glob("*.yaml"):
        assert "kind: Secret" not in path.read_text(), path.name
