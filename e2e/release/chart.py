"""rota's Helm chart from Python: find helm and promtool, render the chart, and keep
``manifests/`` equal to what the chart renders.

``manifests/*.yaml`` (not ``manifests/examples/``) is generated: ``make manifests`` (this
module's ``render-manifests`` command) renders the chart with ``charts/rota/ci/
manifests-values.yaml`` and writes one file per template; a test fails when the files and
``helm template`` disagree.

The tools are built from the Go module proxy by ``e2e/toolchain/build-chart-tools.sh`` into a cache
outside the repository; ``ROTA_CHART_TOOLS_BIN`` names a directory that holds them already.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.release.toolchain import tool_dir

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "rota"
MANIFESTS = ROOT / "manifests"
MANIFEST_VALUES = CHART / "ci" / "manifests-values.yaml"
BUILD_SCRIPT = ROOT / "e2e" / "toolchain" / "build-chart-tools.sh"
KUBE_VERSION = "1.37.2"
"""The Kubernetes version ``helm template`` renders for (it has no cluster to ask)."""
RELEASE, NAMESPACE = "rota", "rota-system"
HEADER = ("# Rendered from charts/rota by `make manifests` (values: charts/rota/ci/"
          "manifests-values.yaml).\n# Do not edit: change the chart and render again.\n")
_SOURCE = re.compile(r"^# Source: [^/]+/templates/(?P<file>[^\n]+)$", re.MULTILINE)


class ChartToolError(RuntimeError):
    """helm or promtool is missing or failed; the message carries its output."""


def tools_bin() -> Path:
    """The directory holding helm and promtool (built on first use, then cached)."""
    return tool_dir("ROTA_CHART_TOOLS_BIN", BUILD_SCRIPT, error=ChartToolError)


def run_tool(tool: str, args: Sequence[str], *, bin_dir: Path | None = None,
             env: Mapping[str, str] | None = None, timeout_s: float = 120.0,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``helm`` or ``promtool`` with ``args`` (``env`` added to this process's
    environment); raise on a non-zero exit when ``check``."""
    exe = (bin_dir or tools_bin()) / tool
    done = subprocess.run([str(exe), *args], capture_output=True, text=True, check=False,
                          timeout=timeout_s, env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise ChartToolError(f"{tool} {' '.join(args)} exited {done.returncode}:\n"
                             f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return done


@dataclass(frozen=True)
class Rendered:
    """``helm template`` output: the text, and its documents by template file."""

    text: str

    def by_template(self) -> dict[str, str]:
        """Template file name -> the YAML documents it rendered (in helm's order)."""
        out: dict[str, list[str]] = {}
        for chunk in self.text.split("\n---\n"):
            match = _SOURCE.search(chunk)
            if match is None:
                continue
            body = chunk[match.end():].strip("\n")
            if not [d for d in yaml.safe_load_all(body) if d]:
                continue
            out.setdefault(match["file"], []).append(body + "\n")
        return {name: "---\n".join(docs) for name, docs in out.items()}

    def documents(self) -> list[dict[str, Any]]:
        return [d for d in yaml.safe_load_all(self.text) if d]

    def find(self, kind: str, name: str | None = None) -> list[dict[str, Any]]:
        return [d for d in self.documents() if d.get("kind") == kind
                and (name is None or d.get("metadata", {}).get("name") == name)]


def render(*, values_files: Sequence[Path] = (), set_values: Mapping[str, str] | None = None,
           release: str = RELEASE, namespace: str = NAMESPACE,
           bin_dir: Path | None = None) -> Rendered:
    """``helm template`` the chart."""
    args = ["template", release, str(CHART), "--namespace", namespace,
            "--kube-version", KUBE_VERSION]
    for path in values_files:
        args += ["--values", str(path)]
    for key, value in (set_values or {}).items():
        args += ["--set", f"{key}={value}"]
    return Rendered(run_tool("helm", args, bin_dir=bin_dir).stdout)


def manifest_files(bin_dir: Path | None = None) -> dict[str, str]:
    """What ``manifests/`` must hold: file name -> content."""
    rendered = render(values_files=[MANIFEST_VALUES], bin_dir=bin_dir)
    return {name: HEADER + body for name, body in sorted(rendered.by_template().items())}


def write_manifests(bin_dir: Path | None = None) -> list[str]:
    """Render ``manifests/*.yaml`` again; remove generated files the chart no longer makes."""
    files = manifest_files(bin_dir)
    for stale in MANIFESTS.glob("*.yaml"):
        if stale.name not in files and stale.read_text().startswith(HEADER.splitlines()[0]):
            stale.unlink()
    for name, content in files.items():
        (MANIFESTS / name).write_text(content)
    return sorted(files)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.release.chart", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("render-manifests", help="write manifests/*.yaml from the chart")
    sub.add_parser("tools", help="build or find helm and promtool; print their directory")
    args = parser.parse_args(argv)
    if args.command == "tools":
        print(tools_bin())
        return 0
    for name in write_manifests():
        print(f"manifests/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
