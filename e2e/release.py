"""``python -m e2e.release``: build a release of rota from a clean checkout into ``dist/``.

``make release VERSION=x.y.z`` runs it. The one source of the version is ``pyproject.toml``'s
``[project] version``; ``VERSION`` (SemVer, as Helm and image tags want it) must name the
same version (``1.2.0-rc.1`` is Python's ``1.2.0rc1``; a pre-release tag that Python has no
spelling for, such as ``0.0.0-test``, is Python's local version ``0.0.0+test``), and
``CHANGELOG.md`` must have a section for it. What comes out, all named in ``SHA256SUMS``:

- ``rota-<py>-py3-none-any.whl`` and ``rota-<py>.tar.gz`` (``python -m build``): the runtime
  packages only (``driver`` with its generated ``driver/pb``, ``controller``), with the
  entry points ``rota-driver``, ``rota-controller``, ``rota-engine-gate``,
  ``rota-engine-guard`` and ``kubectl-rota``;
- ``rota-<py>.wheel.cdx.json``: the wheel's CycloneDX SBOM (``cyclonedx-py environment`` of
  a fresh virtualenv that the wheel was installed into, with its dependencies);
- ``kubectl-rota-<v>.tar.gz`` and ``krew/rota.yaml``: the krew plugin (a launcher of the
  installed package's ``kubectl-rota``) and its manifest;
- ``rota-image-<v>.oci.tar``: rota's image (``e2e.images``, no Docker) as an OCI layout in a
  tar, tagged ``ghcr.io/rota-dev/rota:<v>``, with the OCI labels version, revision,
  licenses, source, title, created; ``rota-image-<v>.cdx.json``: its SBOM (Debian's
  packages of the base layer, Python's of the virtualenv). ``--no-image`` (``make release
  IMAGE=0``) leaves both out, where the machine cannot build images (the builder needs
  root, gcc and Debian's mirror);
- ``rota-<v>.tgz``: the chart (``helm lint --strict``, then ``helm package``), version and
  appVersion ``<v>``, its image pinned by digest (``image.digest``) when the image was built.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parent.parent
IMAGE_REPOSITORY = "ghcr.io/rota-dev/rota"
SOURCE_URL = "https://github.com/rota-dev/rota"
RUNTIME_PACKAGES = ("driver", "controller")
"""The top-level packages the wheel may hold; anything else (``e2e``, ``tests``) fails."""
ENTRY_POINTS = ("kubectl-rota", "rota-controller", "rota-driver", "rota-engine-gate",
                "rota-engine-guard")
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)"
                    r"(?:-([0-9A-Za-z-]+(?:\.[0-9A-Za-z-]+)*))?$")


class ReleaseError(RuntimeError):
    """The release cannot be built; the message says why and what to do."""


def python_version(semver: str) -> str:
    """The Python (PEP 440) spelling of a SemVer release version, normalised."""
    match = SEMVER.match(semver)
    if match is None:
        raise ReleaseError(f"VERSION {semver!r} is not SemVer (x.y.z or x.y.z-pre)")
    try:
        return str(Version(semver))
    except InvalidVersion:
        core, pre = semver.split("-", 1)
        return str(Version(f"{core}+{pre}"))


def project_version(repo: Path) -> str:
    return str(tomllib.loads((repo / "pyproject.toml").read_text())["project"]["version"])


def changelog_has(repo: Path, version: str) -> bool:
    """Whether CHANGELOG.md has a ``## [version]`` (or ``## version``) section."""
    pattern = re.compile(rf"^## \[?v?{re.escape(version)}\]?(\s|$)", re.MULTILINE)
    return bool(pattern.search((repo / "CHANGELOG.md").read_text()))


def _run(argv: Sequence[str], *, cwd: Path | None = None,
         env: Mapping[str, str] | None = None) -> str:
    proc = subprocess.run(list(argv), cwd=cwd, env=None if env is None else dict(env),
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ReleaseError(f"{' '.join(argv)} failed ({proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _git(repo: Path, *args: str) -> str:
    return _run(["git", "-C", str(repo), *args]).strip()


def check_clean(repo: Path) -> str:
    """The commit the release is built from; refuses a tree with changes or untracked
    files (they would end up in the sdist or the image but in no commit)."""
    status = _git(repo, "status", "--porcelain")
    if status:
        raise ReleaseError(f"the tree is not clean; commit or remove first:\n{status}")
    return _git(repo, "rev-parse", "HEAD")


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


# --- the Python package ------------------------------------------------------------------

def build_python(repo: Path, dist: Path, epoch: str) -> tuple[Path, Path]:
    """Wheel and sdist (``python -m build``), the wheel checked to hold the runtime only;
    file times are the commit's (``SOURCE_DATE_EPOCH``), so a rebuild gives the same bytes."""
    _run([sys.executable, "-m", "build", "--sdist", "--wheel", "--outdir", str(dist),
          str(repo)], env={**os.environ, "SOURCE_DATE_EPOCH": epoch})
    (wheel,) = dist.glob("rota-*.whl")
    (sdist,) = dist.glob("rota-*.tar.gz")
    check_wheel(wheel)
    check_sdist(sdist)
    return wheel, sdist


def sdist_top_levels(sdist: Path) -> set[str]:
    """The sdist's top-level entries below its ``rota-<version>/`` directory."""
    with tarfile.open(sdist) as archive:
        return {parts[1] for parts in (name.split("/") for name in archive.getnames())
                if len(parts) > 1 and parts[1]}


def check_sdist(sdist: Path) -> None:
    allowed = {*RUNTIME_PACKAGES, "PKG-INFO", "README.md", "pyproject.toml", "setup.cfg",
               "MANIFEST.in", "rota.egg-info"}
    extra = sdist_top_levels(sdist) - allowed
    if extra:
        raise ReleaseError(f"{sdist.name} holds more than rota's runtime: {sorted(extra)}")


def wheel_top_levels(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name.split("/", 1)[0] for name in archive.namelist()
                if not name.split("/", 1)[0].endswith(".dist-info")}


def wheel_entry_points(wheel: Path) -> dict[str, str]:
    with zipfile.ZipFile(wheel) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")]
        text = archive.read(name).decode()
    points: dict[str, str] = {}
    section = ""
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and section == "console_scripts":
            key, value = (part.strip() for part in line.split("=", 1))
            points[key] = value
    return points


def check_wheel(wheel: Path) -> None:
    extra = wheel_top_levels(wheel) - set(RUNTIME_PACKAGES)
    if extra:
        raise ReleaseError(f"{wheel.name} holds more than rota's runtime: {sorted(extra)}")
    missing = set(ENTRY_POINTS) - set(wheel_entry_points(wheel))
    if missing:
        raise ReleaseError(f"{wheel.name} lacks entry points {sorted(missing)}")


def wheel_sbom(wheel: Path, dest: Path, repo: Path, scratch: Path) -> None:
    """CycloneDX SBOM of the wheel as installed: a fresh virtualenv with the wheel and its
    dependencies from the package index, read by ``cyclonedx-py environment``."""
    venv = scratch / "sbom-venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    python = venv / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
          str(wheel)])
    cyclonedx = Path(sys.executable).with_name("cyclonedx-py")
    _run([str(cyclonedx), "environment", "--pyproject", str(repo / "pyproject.toml"),
          "--output-reproducible", "--of", "JSON", "-o", str(dest), str(python)])


# --- krew --------------------------------------------------------------------------------

KREW_LAUNCHER = """#!/bin/sh
# kubectl rota: the kubectl-rota of the Python package rota ({py}); install it first:
#   python3 -m pip install 'rota=={py}'   (or pipx install 'rota=={py}')
# Runs the first other kubectl-rota on PATH (pip's or pipx's), else python3's module.
self=$(readlink -f "$0")
IFS=:
for dir in $PATH; do
  candidate="$dir/kubectl-rota"
  if [ -x "$candidate" ] && [ "$(readlink -f "$candidate")" != "$self" ]; then
    exec "$candidate" "$@"
  fi
done
exec python3 -m controller.kubectl_rota "$@"
"""


def _deterministic_tar(dest: Path, files: Mapping[str, tuple[bytes, int]]) -> None:
    with open(dest, "wb") as raw, \
            tarfile.open(fileobj=raw, mode="w:gz", format=tarfile.PAX_FORMAT) as tar:
        for name, (data, mode) in sorted(files.items()):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            tar.addfile(info, io.BytesIO(data))


def build_krew(dist: Path, version: str, py: str) -> Path:
    """The krew plugin archive (a launcher of the installed ``controller.kubectl_rota``)
    and ``krew/rota.yaml``, whose sha256 names the archive."""
    archive = dist / f"kubectl-rota-{version}.tar.gz"
    _deterministic_tar(archive, {"kubectl-rota": (KREW_LAUNCHER.format(py=py).encode(), 0o755)})
    manifest = {
        "apiVersion": "krew.googlecontainertools.github.com/v1alpha2",
        "kind": "Plugin",
        "metadata": {"name": "rota"},
        "spec": {
            "version": f"v{version}",
            "homepage": SOURCE_URL,
            "shortDescription": "Show and switch rota's GPU-sharing inference engines",
            "description": "kubectl rota status shows, per GPU, which engine is awake and "
                           "which sleep; kubectl rota switch <model> asks the node's lease "
                           "controller to wake a model.",
            "caveats": f"kubectl rota runs the Python package rota: install it with\n"
                       f"  python3 -m pip install 'rota=={py}'\n",
            "platforms": [{
                "selector": {"matchExpressions": [
                    {"key": "os", "operator": "In", "values": ["linux", "darwin"]}]},
                "uri": f"{SOURCE_URL}/releases/download/v{version}/{archive.name}",
                "sha256": sha256(archive),
                "bin": "kubectl-rota",
                "files": [{"from": "kubectl-rota", "to": "."}],
            }],
        },
    }
    krew = dist / "krew" / "rota.yaml"
    krew.parent.mkdir(parents=True, exist_ok=True)
    krew.write_text(_yaml(manifest))
    return archive


def _yaml(value: Any) -> str:
    return str(yaml.safe_dump(value, sort_keys=False, default_flow_style=False))


# --- the image ---------------------------------------------------------------------------

def build_image(repo: Path, wheel: Path, dist: Path, version: str, revision: str
                ) -> tuple[str, Path]:
    """The release image's OCI archive and SBOM; returns its digest and archive."""
    from e2e.images.build import BuildError, build_release_image

    created = _git(repo, "show", "-s", "--format=%cI", revision)
    license_ = str(tomllib.loads((repo / "pyproject.toml").read_text())["project"]["license"])
    labels = {
        "org.opencontainers.image.title": "rota",
        "org.opencontainers.image.description": "rota's driver, lease controller, gateway "
                                                "and engine guard",
        "org.opencontainers.image.version": version,
        "org.opencontainers.image.revision": revision,
        "org.opencontainers.image.licenses": license_,
        "org.opencontainers.image.source": SOURCE_URL,
        "org.opencontainers.image.created": created,
    }
    archive = dist / f"rota-image-{version}.oci.tar"
    try:
        image = build_release_image(repo, wheel, name=f"{IMAGE_REPOSITORY}:{version}",
                                    labels=labels, dest=archive)
    except BuildError as error:
        raise ReleaseError(f"the image could not be built (IMAGE=0 / --no-image leaves it "
                           f"out): {error}") from error
    sbom = image_sbom(image.name, image.digest, version, image.debs, image.python_packages,
                      created)
    (dist / f"rota-image-{version}.cdx.json").write_text(json.dumps(sbom, indent=2) + "\n")
    return image.digest, archive


def image_sbom(name: str, digest: str, version: str, debs: Sequence[str],
               python_packages: Mapping[str, str], created: str) -> dict[str, Any]:
    """A CycloneDX 1.6 SBOM of the image: Debian's packages and the virtualenv's."""
    components: list[dict[str, Any]] = []
    for deb in sorted(debs):
        package, deb_version, arch = Path(deb).name.removesuffix(".deb").split("_")
        deb_version = deb_version.replace("%3a", ":")
        components.append({
            "type": "library", "name": package, "version": deb_version,
            "bom-ref": f"pkg:deb/debian/{package}@{deb_version}?arch={arch}",
            "purl": f"pkg:deb/debian/{package}@{deb_version}?arch={arch}"})
    for package, py_version in sorted(python_packages.items()):
        purl = f"pkg:pypi/{package.lower().replace('_', '-')}@{py_version}"
        components.append({"type": "library", "name": package, "version": py_version,
                           "bom-ref": purl, "purl": purl})
    return {
        "bomFormat": "CycloneDX", "specVersion": "1.6", "version": 1,
        "metadata": {
            "timestamp": created,
            "component": {"type": "container", "name": name.rsplit(":", 1)[0],
                          "version": version, "bom-ref": f"{name}@{digest}",
                          "hashes": [{"alg": "SHA-256", "content": digest.split(":", 1)[1]}]},
        },
        "components": components,
    }


# --- the chart ---------------------------------------------------------------------------

def _set_line(text: str, pattern: str, replacement: str) -> str:
    new, count = re.subn(pattern, replacement, text, count=1, flags=re.MULTILINE)
    if count != 1:
        raise ReleaseError(f"no line matches {pattern!r}")
    return new


def stage_chart(repo: Path, scratch: Path, version: str, digest: str | None) -> Path:
    """A copy of ``charts/rota`` with the release's version, appVersion and image digest."""
    chart = scratch / "chart" / "rota"
    shutil.copytree(repo / "charts" / "rota", chart)
    meta = chart / "Chart.yaml"
    text = _set_line(meta.read_text(), r"^version:.*$", f"version: {version}")
    meta.write_text(_set_line(text, r"^appVersion:.*$", f'appVersion: "{version}"'))
    if digest is not None:
        values = chart / "values.yaml"
        values.write_text(_set_line(values.read_text(), r'^  digest: ""$',
                                    f'  digest: "{digest}"'))
    return chart


def package_chart(chart: Path, dist: Path, helm: Path) -> Path:
    _run([str(helm), "lint", "--strict", str(chart)])
    out = _run([str(helm), "package", str(chart), "--destination", str(dist)])
    match = re.search(r"saved it to: (\S+)", out)
    if match is None:
        raise ReleaseError(f"helm package said: {out}")
    return Path(match.group(1))


def helm_binary() -> Path:
    bin_dir = os.environ.get("ROTA_CHART_TOOLS_BIN")
    if bin_dir:
        return Path(bin_dir) / "helm"
    found = shutil.which("helm")
    if found is None:
        raise ReleaseError("no helm: set ROTA_CHART_TOOLS_BIN (bash e2e/build-chart-tools.sh)")
    return Path(found)


# --- sums and the whole ------------------------------------------------------------------

def write_sums(dist: Path) -> Path:
    """``SHA256SUMS`` of every file under ``dist`` (``sha256sum -c`` reads it)."""
    sums = dist / "SHA256SUMS"
    lines = [f"{sha256(path)}  {path.relative_to(dist).as_posix()}"
             for path in sorted(dist.rglob("*")) if path.is_file() and path != sums]
    sums.write_text("\n".join(lines) + "\n")
    return sums


def release(repo: Path, dist: Path, version: str | None, *, image: bool) -> list[Path]:
    """Build every artifact of the release into ``dist`` (emptied first); their paths."""
    revision = check_clean(repo)
    declared = project_version(repo)
    version = version or declared
    if python_version(version) != str(Version(declared)):
        raise ReleaseError(
            f"VERSION {version} is Python's {python_version(version)}, but pyproject.toml "
            f"says {declared}: set [project] version there (the one source) and commit")
    if not changelog_has(repo, version):
        raise ReleaseError(f"CHANGELOG.md has no section '## [{version}]': write it first")
    helm = helm_binary()
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="rota-release-") as tmp:
        scratch = Path(tmp)
        wheel, _ = build_python(repo, dist, _git(repo, "show", "-s", "--format=%ct", revision))
        wheel_sbom(wheel, dist / f"{wheel.name.removesuffix('-py3-none-any.whl')}.wheel.cdx.json",
                   repo, scratch)
        build_krew(dist, version, declared)
        digest = None
        if image:
            digest, _ = build_image(repo, wheel, dist, version, revision)
        package_chart(stage_chart(repo, scratch, version, digest), dist, helm)
    write_sums(dist)
    return sorted(p for p in dist.rglob("*") if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.release", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", default="",
                        help="SemVer of the release (default: pyproject.toml's version)")
    parser.add_argument("--dist", type=Path, default=REPO / "dist")
    parser.add_argument("--repo", type=Path, default=REPO)
    parser.add_argument("--no-image", action="store_true",
                        help="leave out the image (and the chart's digest pin)")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        built = release(args.repo.resolve(), args.dist.resolve(), args.version or None,
                        image=not args.no_image)
    except ReleaseError as error:
        print(f"release: {error}", file=sys.stderr)
        return 1
    for path in built:
        print(path)
    print(f"release built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
