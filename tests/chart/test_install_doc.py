"""docs/install.md's helm commands work as written with the project's own helm.

The project's helm is built from source without a Kubernetes version, so ``helm template``
without ``--kube-version`` renders for 1.20, which the chart refuses: a user following the
docs with such a helm (or any helm without a cluster to ask) must be told to pass one. The
commands that need no cluster (``helm template``, ``lint``, ``show``) run here as written
(placeholders filled in); the ones that need a cluster (``install``, ``upgrade``) are
rendered with ``helm template`` and the same flags, and every ``--set`` key must be a value
the chart has.
"""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.release.chart import CHART, KUBE_VERSION
from tests.docs.blocks import ROOT, blocks_of

INSTALL_MD = ROOT / "docs" / "install.md"
PLACEHOLDERS = {"<ns>": "inference", "<version>": "0.1.0"}
"""What the test writes where the docs leave a name to the reader."""
LOCAL = frozenset({"template", "lint", "show"})
ON_CLUSTER = frozenset({"install", "upgrade"})
_ONLY_ON_CLUSTER = frozenset({"--create-namespace", "--wait", "--atomic", "--reuse-values"})


def _helm_commands() -> list[list[str]]:
    """Every ``helm`` command of install.md's command blocks: continuation lines joined,
    comments dropped, each pipeline cut at ``|``, placeholders filled in."""
    found: list[list[str]] = []
    for block in blocks_of(INSTALL_MD):
        if not block.is_commands:
            continue
        text = block.text.replace("\\\n", " ")
        for name, value in PLACEHOLDERS.items():
            text = text.replace(name, value)
        for line in text.splitlines():
            for part in line.split("|"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["helm"]:
                    found.append(words)
    return found


def _where(words: list[str]) -> str:
    return " ".join(words)


def _helm(chart_bin: Path, helm_home: dict[str, str], args: list[str]
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(chart_bin / "helm"), *args], cwd=ROOT, capture_output=True,
                          text=True, check=False, timeout=120,
                          env={"PATH": "/usr/bin:/bin", **helm_home})


def _set_keys(words: list[str]) -> list[str]:
    keys = []
    for i, word in enumerate(words):
        if word in ("--set", "--set-string") and i + 1 < len(words):
            keys.append(words[i + 1].split("=", 1)[0])
        elif word.startswith(("--set=", "--set-string=")):
            keys.append(word.split("=", 1)[1].split("=", 1)[0])
    return keys


def _has_value(values: dict[str, Any], key: str) -> bool:
    """``key`` (dotted) names a value of values.yaml, or a key under a free-form map
    (one whose default is ``{}``)."""
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, dict):
            return False
        if part not in node:
            return node == {}
        node = node[part]
    return True


def test_install_md_has_helm_commands_of_both_kinds() -> None:
    verbs = {words[1] for words in _helm_commands()}
    assert verbs & LOCAL
    assert verbs & ON_CLUSTER
    assert verbs <= LOCAL | ON_CLUSTER, f"a helm command this test does not know: {verbs}"


@pytest.mark.parametrize("words", [w for w in _helm_commands() if w[1] in LOCAL], ids=_where)
def test_a_command_that_needs_no_cluster_runs_as_written(
        chart_bin: Path, helm_home: dict[str, str], words: list[str]) -> None:
    done = _helm(chart_bin, helm_home, words[1:])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()


@pytest.mark.parametrize("words", [w for w in _helm_commands() if w[1] in ON_CLUSTER],
                         ids=_where)
def test_a_command_that_needs_a_cluster_sets_values_the_chart_has(
        chart_bin: Path, helm_home: dict[str, str], words: list[str]) -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    unknown = [key for key in _set_keys(words) if not _has_value(values, key)]
    assert not unknown, f"{_where(words)} sets values the chart does not have: {unknown}"
    # The same flags, rendered: the schema and the templates accept them.
    release, _chart, *flags = words[2:]
    kept: list[str] = []
    skip = False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--version":
            skip = True  # a registry chart's version: this test renders the clone's chart
        elif flag not in _ONLY_ON_CLUSTER:
            kept.append(flag)
    done = _helm(chart_bin, helm_home, ["template", release, str(CHART), *kept,
                                         "--kube-version", KUBE_VERSION])
    assert done.returncode == 0, done.stderr
