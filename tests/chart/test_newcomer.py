"""What a newcomer meets first (review newcomer-2026-12-06, findings 3, 5, 12): the chart
README's own install line serves a model, NOTES warns when no namespace may serve one,
every generated README row carries its own key's comment, the schema types security
contexts, and a PodDisruptionBudget that blocks every drain is refused."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from e2e.release.chart import CHART, KUBE_VERSION, Rendered, run_tool
from e2e.release.chart_readme import main as readme_main
from e2e.release.chart_readme import render as render_readme

NOTES_AS_OBJECT = """{{- define "test.notes" }}%s{{- end }}
apiVersion: v1
kind: ConfigMap
metadata: {name: notes}
data:
  notes: {{ include "test.notes" . | toJson }}
"""


def _template(chart_bin: Path, *args: str, chart: Path = CHART
              ) -> subprocess.CompletedProcess[str]:
    return run_tool("helm", ["template", "rota", str(chart), "--namespace", "rota-system",
                             "--kube-version", KUBE_VERSION, *args],
                    bin_dir=chart_bin, check=False)


def _install_line() -> list[str]:
    """The README's install command, its --set flags with the placeholder filled in."""
    text = render_readme()
    block = text.split("```sh\n", 1)[1].split("```", 1)[0]
    helm = block.replace("\\\n", " ").split("\n")[1]
    helm = helm.replace("<namespace of your engines>", "inference")
    return [s.replace("'", "") for s in re.findall(r"--set (\S+)", helm)]


def _notes(chart_bin: Path, tmp_path: Path, *sets: str) -> str:
    chart = tmp_path / "rota"
    shutil.copytree(CHART, chart)
    notes = (chart / "templates" / "NOTES.txt").read_text()
    (chart / "templates" / "notes-as-object.yaml").write_text(NOTES_AS_OBJECT % notes)
    args = [a for s in sets for a in ("--set", s)]
    done = _template(chart_bin, *args, "--show-only", "templates/notes-as-object.yaml",
                     chart=chart)
    assert done.returncode == 0, done.stderr
    (config_map,) = Rendered(done.stdout).find("ConfigMap", "notes")
    return str(config_map["data"]["notes"])


def test_the_readme_install_line_binds_a_namespace(chart_bin: Path) -> None:
    sets = _install_line()
    assert "gateway.modelBinding.namespaces={inference}" in sets
    done = _template(chart_bin, *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr
    (binding,) = Rendered(done.stdout).find("ConfigMap", "rota-gateway-model-binding")
    assert yaml.safe_load(binding["data"]["binding.yaml"])["namespaces"] == ["inference"]


def test_notes_warn_when_the_binding_is_empty(chart_bin: Path, tmp_path: Path) -> None:
    empty = _notes(chart_bin, tmp_path, "engineNamespaces={inference}")
    assert "gateway.modelBinding is empty" in empty
    assert "--set gateway.modelBinding.namespaces={inference}" in empty
    bound = _notes(chart_bin, tmp_path / "b", "engineNamespaces={inference}",
                   "gateway.modelBinding.namespaces={inference}")
    assert "gateway.modelBinding is empty" not in bound


def _row(readme: str, key: str) -> str:
    (row,) = [line for line in readme.splitlines() if line.startswith(f"| `{key}` |")]
    return row


def test_every_comment_is_on_its_own_key() -> None:
    readme = render_readme()
    assert "org/llama-70b: [prod]" in _row(readme, "gateway.modelBinding.models")
    assert "- inference" in _row(readme, "gateway.modelBinding.namespaces")
    assert "org/llama-70b" not in _row(readme, "gateway.modelBinding.namespaces")
    assert "inference" not in _row(readme, "gateway.modelBinding.progress")
    assert "engine-api-key" in _row(readme, "gateway.engineApiKeySecrets")
    assert "engine-api-key" not in _row(readme, "gateway.podDisruptionBudget")
    assert "drain" in _row(readme, "gateway.podDisruptionBudget")
    assert "queue_full" in _row(readme, "gateway.queueSize")
    assert "Client API keys" in _row(readme, "gateway.apiKeys")


def test_a_commented_example_under_an_empty_key_stays_with_it(tmp_path: Path) -> None:
    chart = tmp_path / "rota"
    shutil.copytree(CHART, chart)
    values = chart / "values.yaml"
    values.write_text(values.read_text().replace(
        "imagePullSecrets: []\n", "imagePullSecrets: []\n#  - name: regcred\n", 1))
    assert readme_main(["--chart", str(chart)]) == 0
    readme = (chart / "README.md").read_text()
    assert "regcred" in _row(readme, "imagePullSecrets")
    assert "regcred" not in _row(readme, "deviceClass")


def test_the_readme_types_security_contexts() -> None:
    readme = render_readme()
    assert "| boolean |" in _row(readme, "driver.securityContext.privileged")
    assert "| integer |" in _row(readme, "controller.podSecurityContext.runAsUser")


@pytest.mark.parametrize("wrong", [
    "driver.securityContext.privileged=maybe",
    "controller.securityContext.readOnlyRootFilesystem=yes",
    "gateway.podSecurityContext.runAsUser=root",
    "gateway.securityContext.privilegd=true",
    "controller.podSecurityContext.seccompProfile.type=Sometimes",
    "gateway.podDisruptionBudget.minAvailable=half",
])
def test_the_schema_refuses_wrong_security_contexts(chart_bin: Path, wrong: str) -> None:
    done = _template(chart_bin, "--set", "engineNamespaces={inference}", "--set", wrong)
    assert done.returncode != 0, wrong
    assert wrong.split("=")[0].split(".")[-1] in done.stderr, done.stderr


@pytest.mark.parametrize(("replicas", "min_available", "refused"),
                         [(2, 2, True), (2, 5, True), (3, 2, False), (2, "50%", False),
                          (1, 1, False)])
def test_a_budget_that_blocks_every_drain_is_refused(
        chart_bin: Path, replicas: int, min_available: int | str, refused: bool) -> None:
    done = _template(chart_bin, "--set", "engineNamespaces={inference}",
                     "--set", f"gateway.replicas={replicas}",
                     "--set-string" if isinstance(min_available, str) else "--set",
                     f"gateway.podDisruptionBudget.minAvailable={min_available}")
    assert (done.returncode != 0) is refused, done.stderr
    if refused:
        assert "no drain could ever evict" in done.stderr
    elif replicas == 1:  # the only replica: no budget at all, so drains are never blocked
        assert "kind: PodDisruptionBudget" not in done.stdout
