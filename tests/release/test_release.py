"""``make release`` in a clean clone: every artifact of the release, checked as a user would.

The clone gets what a release engineer commits before a release (pyproject's version, the
CHANGELOG section) and its tag, then ``make release VERSION=0.0.0-test`` runs with this
checkout's virtualenv. The image is part of it where the image builder can run (root, gcc).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.release.artifacts import (
    ReleaseError,
    changelog_has,
    python_version,
    release,
    sdist_top_levels,
    wheel_entry_points,
    wheel_top_levels,
)
from e2e.release.chart import tools_bin
from tests.release.releases import IMAGE_BUILDS, Release, clone, git, make_release

pytestmark = pytest.mark.slow

VERSION = "0.0.0-test"
PY_VERSION = "0.0.0+test"


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Release:
    return make_release(clone(tmp_path_factory.mktemp("release") / "rota"), VERSION)


def test_sha256sums_name_and_verify_every_artifact(built: Release) -> None:
    listed: dict[str, str] = {}
    for line in (built.dist / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split("  ", 1)
        listed[name] = digest
    files = {p.relative_to(built.dist).as_posix() for p in built.dist.rglob("*")
             if p.is_file() and p.name != "SHA256SUMS"}
    assert set(listed) == files
    for name, digest in listed.items():
        assert hashlib.sha256((built.dist / name).read_bytes()).hexdigest() == digest, name
    done = subprocess.run(["sha256sum", "--check", "--strict", "SHA256SUMS"], cwd=built.dist,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_wheel_and_sdist_hold_the_runtime_only(built: Release) -> None:
    wheel = built.one("rota-*.whl")
    assert wheel.name == f"rota-{PY_VERSION}-py3-none-any.whl"
    assert wheel_top_levels(wheel) == {"driver", "controller", "rota"}
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (metadata,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        requires = [line for line in archive.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    assert not [n for n in names if n.startswith(("e2e/", "tests/"))]
    assert any(n.startswith("rota/pb/") for n in names)  # the generated gRPC code
    runtime = [r for r in requires if "extra ==" not in r]
    assert not [r for r in runtime if "cryptography" in r]  # the harness's, in an extra
    assert "kubectl-rota" in wheel_entry_points(wheel)
    assert sdist_top_levels(built.one("rota-*.tar.gz")) <= {
        "driver", "controller", "rota", "PKG-INFO", "README.md", "pyproject.toml", "setup.cfg",
        "MANIFEST.in", "rota.egg-info"}


def test_the_wheel_installs_in_a_fresh_virtualenv_and_kubectl_rota_runs(
        built: Release, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    install = subprocess.run([str(venv / "bin" / "pip"), "install", "-q",
                              "--disable-pip-version-check", str(built.one("rota-*.whl"))],
                             capture_output=True, text=True, check=False)
    assert install.returncode == 0, install.stderr[-3000:]
    done = subprocess.run([str(venv / "bin" / "kubectl-rota"), "--help"], cwd=tmp_path,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert "status" in done.stdout
    assert "switch" in done.stdout
    for tool in ("rota-driver", "rota-controller", "rota-engine-gate", "rota-engine-guard"):
        assert (venv / "bin" / tool).exists(), tool
    # krew's plugin: its launcher finds the package's kubectl-rota on PATH
    plugin = tmp_path / "krew"
    with tarfile.open(built.one("kubectl-rota-*.tar.gz")) as tar:
        tar.extractall(plugin, filter="data")
    launched = subprocess.run(
        [str(plugin / "kubectl-rota"), "--help"], cwd=tmp_path, capture_output=True,
        text=True, check=False,
        env={**os.environ, "PATH": f"{plugin}:{venv / 'bin'}:/usr/bin:/bin"})
    assert launched.returncode == 0, launched.stderr
    assert launched.stdout == done.stdout
    imported = subprocess.run([str(venv / "bin" / "python"), "-c", "import e2e"],
                              cwd=tmp_path, capture_output=True, text=True, check=False)
    assert imported.returncode != 0  # the harness is not installed


def test_the_wheel_has_a_cyclonedx_sbom(built: Release) -> None:
    sbom = json.loads(built.one("rota-*.wheel.cdx.json").read_text())
    assert sbom["bomFormat"] == "CycloneDX"
    assert sbom["metadata"]["component"]["name"] == "rota"
    names = {c["name"].lower() for c in sbom["components"]}
    assert {"kubernetes", "grpcio", "pydantic", "aiohttp"} <= names


def test_the_krew_manifest_names_the_plugin_archive(built: Release) -> None:
    plugin = yaml.safe_load((built.dist / "krew" / "rota.yaml").read_text())
    assert plugin["kind"] == "Plugin"
    assert plugin["metadata"]["name"] == "rota"
    assert plugin["spec"]["version"] == f"v{VERSION}"
    (platform,) = plugin["spec"]["platforms"]
    archive = built.one("kubectl-rota-*.tar.gz")
    assert platform["uri"].endswith(f"/v{VERSION}/{archive.name}")
    assert platform["sha256"] == hashlib.sha256(archive.read_bytes()).hexdigest()
    with tarfile.open(archive) as tar:
        member = tar.getmember(platform["bin"])
        assert member.mode & 0o111


def _helm(*args: str) -> str:
    done = subprocess.run([str(tools_bin() / "helm"), *args], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _image_config(archive: Path) -> tuple[str, dict[str, Any]]:
    with tarfile.open(archive) as tar:
        def blob(digest: str) -> dict[str, Any]:
            handle = tar.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}")
            assert handle is not None
            value: dict[str, Any] = json.load(handle)
            return value
        index_file = tar.extractfile("index.json")
        assert index_file is not None
        (entry,) = json.load(index_file)["manifests"]
        manifest = blob(entry["digest"])
        return str(entry["digest"]), blob(manifest["config"]["digest"])


def test_the_chart_lints_and_carries_the_release_version(built: Release) -> None:
    chart = built.one("rota-*.tgz")
    assert chart.name == f"rota-{VERSION}.tgz"
    _helm("lint", "--strict", str(chart))
    meta = yaml.safe_load(_helm("show", "chart", str(chart)))
    assert (meta["version"], str(meta["appVersion"])) == (VERSION, VERSION)
    rendered = _helm("template", "rota", str(chart), "--kube-version", "1.35.0",
                     "--set", "networkPolicy.enginesOpen=true")
    images = set(re.findall(r"image: (\S+)", rendered))
    if IMAGE_BUILDS:
        digest, _ = _image_config(built.one("rota-image-*.oci.tar"))
        assert images == {f"ghcr.io/rota-dev/rota:{VERSION}@{digest}"}
    else:
        assert images == {f"ghcr.io/rota-dev/rota:{VERSION}"}


@pytest.mark.skipif(not IMAGE_BUILDS, reason="the image builder needs root and gcc")
def test_the_image_carries_oci_labels_and_has_an_sbom(built: Release) -> None:
    archive = built.one("rota-image-*.oci.tar")
    with tarfile.open(archive) as tar:
        assert "oci-layout" in tar.getnames()
    digest, config = _image_config(archive)
    labels = config["config"]["Labels"]
    assert labels["org.opencontainers.image.version"] == VERSION
    assert labels["org.opencontainers.image.revision"] == built.revision
    assert labels["org.opencontainers.image.licenses"] == "Apache-2.0"
    assert labels["org.opencontainers.image.source"].startswith("https://")
    sbom = json.loads(built.one("rota-image-*.cdx.json").read_text())
    assert sbom["metadata"]["component"]["bom-ref"].endswith(digest)
    names = {c["name"] for c in sbom["components"]}
    assert {"python3", "rota", "grpcio"} <= {n.split(".")[0] for n in names} | names


def test_version_rules() -> None:
    assert python_version("1.2.3") == "1.2.3"
    assert python_version("1.2.3-rc.1") == "1.2.3rc1"
    assert python_version("0.0.0-test") == "0.0.0+test"
    with pytest.raises(ReleaseError):
        python_version("1.2")


def test_changelog_sections(tmp_path: Path) -> None:
    (tmp_path / "CHANGELOG.md").write_text(
        "# Changelog\n\n## [1.2.0] - 2026-12-01\n\n## 1.1.0\n")
    assert changelog_has(tmp_path, "1.2.0")
    assert changelog_has(tmp_path, "1.1.0")
    assert not changelog_has(tmp_path, "1.2")


def test_a_release_refuses_a_dirty_tree_a_wrong_version_no_changelog_or_no_tag(
        tmp_path: Path) -> None:
    repo = clone(tmp_path / "rota")
    dist = tmp_path / "dist"
    (repo / "stray.txt").write_text("not committed\n")
    with pytest.raises(ReleaseError, match="not clean"):
        release(repo, dist, VERSION, image=False)
    (repo / "stray.txt").unlink()
    with pytest.raises(ReleaseError, match=r"pyproject\.toml"):
        release(repo, dist, VERSION, image=False)
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(re.sub(r'^version = ".*"$', f'version = "{PY_VERSION}"',
                                pyproject.read_text(), count=1, flags=re.MULTILINE))
    git(repo, "commit", "-q", "-am", "version only")
    with pytest.raises(ReleaseError, match="CHANGELOG"):
        release(repo, dist, VERSION, image=False)
    changelog = repo / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace(
        "## Unreleased", f"## [{VERSION}]\n\n## Unreleased", 1))
    git(repo, "commit", "-q", "-am", "changelog")
    with pytest.raises(ReleaseError, match=f"not tagged v{VERSION}"):
        release(repo, dist, VERSION, image=False)
    assert not dist.exists()


def test_the_provenance_names_the_commit_the_tree_and_every_artifact(built: Release) -> None:
    predicate = json.loads(built.one("rota-*.provenance.json").read_text())
    definition = predicate["buildDefinition"]
    assert definition["externalParameters"]["source"]["digest"] == {
        "gitCommit": built.revision}
    assert definition["externalParameters"]["version"] == VERSION
    assert definition["internalParameters"]["treeState"] == "clean"
    assert definition["internalParameters"]["snapshot"] is False
    assert predicate["runDetails"]["builder"]["id"].startswith("https://")
    products = {p["name"]: p["digest"]["sha256"] for p in predicate["runDetails"]["byproducts"]}
    assert f"rota-{VERSION}.tgz" in products
    for name, digest in products.items():
        assert hashlib.sha256((built.dist / name).read_bytes()).hexdigest() == digest, name
