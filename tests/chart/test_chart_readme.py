"""The chart's README is generated from values.yaml and values.schema.json and is current:
CI fails when a value changes without ``make chart-readme``; ``helm show readme`` gives it."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from e2e.release.chart_readme import CHART, main, render, values_of


def test_the_chart_readme_is_current() -> None:
    assert main(["--check"]) == 0, "charts/rota/README.md is stale: run make chart-readme"


def test_a_changed_value_makes_the_readme_stale(tmp_path: Path) -> None:
    chart = tmp_path / "rota"
    shutil.copytree(CHART, chart)
    assert main(["--chart", str(chart), "--check"]) == 0
    values = chart / "values.yaml"
    values.write_text(values.read_text().replace("  enginesPerGpu: 8", "  enginesPerGpu: 4", 1))
    assert main(["--chart", str(chart), "--check"]) == 1
    assert main(["--chart", str(chart)]) == 0
    assert main(["--chart", str(chart), "--check"]) == 0
    assert "| `sharing.enginesPerGpu` | integer | `4` |" in (chart / "README.md").read_text()


def test_every_value_has_a_row_with_the_schemas_type() -> None:
    readme = render()
    for value in values_of(CHART):
        if not value.section:
            assert f"| `{'.'.join(value.path)}` |" in readme
    assert "| `image.digest` | string | `\"\"` |" in readme
    assert '| `sharing.mode` | "shared" \\| "partitioned" \\| "exclusive" |' in readme


def test_helm_show_readme_gives_it(chart_bin: Path) -> None:
    done = subprocess.run([str(chart_bin / "helm"), "show", "readme", str(CHART)],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == (CHART / "README.md").read_text().strip()
