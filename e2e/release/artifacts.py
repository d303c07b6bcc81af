"""``python -m e2e.release``: build rota's artifacts from any commit into ``dist/``, push
them to a registry with cosign signatures and provenance, and verify them there.

``make release`` (``build``) works on every commit, so anyone can build an image and a chart:

- **a snapshot** where the tree is not a tagged release (no ``VERSION`` given and HEAD not at
  a ``v<version>`` tag with a CHANGELOG section, or a dirty tree): its version is derived
  from the commit, as the next release's pre-release, ``<next>-dev.<commit time>.g<sha12>``
  for the image tag and the chart (SemVer: Helm and OCI tags need it; ``+`` is no tag
  character, so the commit is a pre-release field, and ``g`` keeps an all-digit sha from
  being a number) and ``<next>.dev<commit time>+g<sha12>`` for the wheel (PEP 440: a
  development release, so ``pip`` never takes it for a release, with the commit as local
  label). Both sort before ``<next>`` and, by the commit time, one after the other; a dirty
  tree adds ``.dirty`` to both and names its changed paths in the provenance. ``<next>`` is
  ``pyproject.toml``'s version.
- **a release** (``make release VERSION=x.y.z``, or no ``VERSION`` on a tree that is a tagged
  release): every check, refused otherwise: a clean tree, ``pyproject.toml``'s
  ``[project] version`` (the one source) naming the same version (``1.2.0-rc.1`` is Python's
  ``1.2.0rc1``; a pre-release tag that Python has no spelling for, such as ``0.0.0-test``, is
  Python's local version ``0.0.0+test``), a ``CHANGELOG.md`` section, and HEAD tagged
  ``v<VERSION>``.

What comes out, all named in ``SHA256SUMS``:

- ``rota-<py>-py3-none-any.whl`` and ``rota-<py>.tar.gz`` (``python -m build``): the runtime
  packages only (``driver`` with its generated ``rota/pb``, ``controller``), with the
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
  appVersion ``<v>``, its image pinned by digest (``image.digest``) when the image was built;
- ``rota-<v>.provenance.json``: a SLSA v1 provenance predicate of the build (the commit, the
  tree's state, the builder, every artifact's sha256), which ``push`` attests.

``make push REGISTRY=<host>/<path> SIGNING_KEY=cosign.key`` (``push``) puts the image at
``<REGISTRY>/rota:<v>`` and the chart at ``oci://<REGISTRY>/charts/rota`` (``crane push``,
``helm push``; ``PLAIN_HTTP=1`` for a registry without TLS), then signs both by digest with
the cosign key file and attests the provenance to both (``cosign sign``, ``cosign attest
--type slsaprovenance1``; ``COSIGN_PASSWORD`` unlocks the key; nothing goes to a public
transparency log). ``make verify REGISTRY=... VERSION=<v> PUBLIC_KEY=cosign.pub``
(``verify``) checks the signatures and the provenance of both before an install; docs/
install.md has the same as plain cosign commands. crane, helm and cosign are built from
the Go module proxy into rota's tool cache (``e2e/toolchain/build-registry.sh``,
``e2e/toolchain/build-chart-tools.sh``, ``e2e/toolchain/build-cosign.sh``).
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.version import InvalidVersion, Version

REPO = Path(__file__).resolve().parents[2]
IMAGE_REPOSITORY = "ghcr.io/rota-dev/rota"
SOURCE_URL = "https://github.com/rota-dev/rota"
RUNTIME_PACKAGES = ("driver", "controller", "rota")
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


# --- what is built: a release or a snapshot ----------------------------------------------

@dataclass(frozen=True)
class Plan:
    """The version a build carries and the source state it was made from."""

    version: str
    """SemVer: the image tag, the chart's version and appVersion."""
    python: str
    """PEP 440: the wheel's and the sdist's version."""
    revision: str
    snapshot: bool
    changed: tuple[str, ...] = ()
    """``git status --porcelain`` lines of a dirty tree (a snapshot only)."""

    @property
    def tree_state(self) -> str:
        return "dirty" if self.changed else "clean"


def _status(repo: Path) -> tuple[str, ...]:
    out = _run(["git", "-C", str(repo), "status", "--porcelain"])
    return tuple(line for line in out.splitlines() if line.strip())


def tags_at_head(repo: Path) -> list[str]:
    return _git(repo, "tag", "--points-at", "HEAD").split()


def snapshot_versions(next_version: str, revision: str, commit_time: int,
                      dirty: bool) -> tuple[str, str]:
    """(SemVer, PEP 440) of a snapshot of ``revision``: pre-releases of ``next_version``
    (pyproject's) ordered by the commit's time, naming the commit (module docstring)."""
    base = Version(next_version).base_version
    stamp = time.strftime("%Y%m%d%H%M%S", time.gmtime(commit_time))
    sha = revision[:12]
    suffix = ".dirty" if dirty else ""
    return f"{base}-dev.{stamp}.g{sha}{suffix}", f"{base}.dev{stamp}+g{sha}{suffix}"


def release_plan(repo: Path, requested: str | None) -> Plan:
    """A release where one is asked for (every check, refused otherwise) or HEAD is a
    tagged release already; a snapshot of the commit otherwise."""
    revision = _git(repo, "rev-parse", "HEAD")
    if requested:
        check_release(repo, requested)
        return Plan(requested, python_version(requested), revision, snapshot=False)
    declared = project_version(repo)
    changed = _status(repo)
    for tag in tags_at_head(repo):
        semver = tag.removeprefix("v")
        if not changed and SEMVER.match(semver) and changelog_has(repo, semver) \
                and Version(python_version(semver)) == Version(declared):
            return Plan(semver, python_version(semver), revision, snapshot=False)
    commit_time = int(_git(repo, "show", "-s", "--format=%ct", revision))
    semver, python = snapshot_versions(declared, revision, commit_time, bool(changed))
    return Plan(semver, python, revision, snapshot=True, changed=changed)


def check_release(repo: Path, version: str) -> None:
    """Every check of a real release: a clean tree, pyproject's version, the CHANGELOG's
    section and HEAD at the tag ``v<version>``; the error says what to do."""
    check_clean(repo)
    declared = project_version(repo)
    if python_version(version) != str(Version(declared)):
        raise ReleaseError(
            f"VERSION {version} is Python's {python_version(version)}, but pyproject.toml "
            f"says {declared}: set [project] version there (the one source) and commit")
    if not changelog_has(repo, version):
        raise ReleaseError(f"CHANGELOG.md has no section '## [{version}]': write it first")
    if f"v{version}" not in tags_at_head(repo):
        raise ReleaseError(f"HEAD is not tagged v{version}: tag the release commit first "
                           f"(git tag -a v{version} -m 'rota {version}'); without VERSION, "
                           f"make release builds a snapshot of the commit")


def stage_source(repo: Path, dest: Path, python: str) -> Path:
    """The tree as it is (tracked and untracked files, not ignored ones) copied to
    ``dest`` with pyproject's version set to ``python``: the wheel is built from it, so a
    snapshot's version is in its metadata and the checkout is left as it was."""
    listed = _run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others",
                   "--exclude-standard"])
    for name in filter(None, listed.split("\0")):
        source, target = repo / name, dest / name
        if source.is_symlink() or source.is_file():  # a file deleted in the tree is left out
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target, follow_symlinks=False)
    pyproject = dest / "pyproject.toml"
    pyproject.write_text(_set_line(pyproject.read_text(), r'^version = ".*"$',
                                   f'version = "{python}"'))
    return dest


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
        raise ReleaseError("no helm: set ROTA_CHART_TOOLS_BIN "
                           "(bash e2e/toolchain/build-chart-tools.sh)")
    return Path(found)


# --- sums and the whole ------------------------------------------------------------------

def write_sums(dist: Path) -> Path:
    """``SHA256SUMS`` of every file under ``dist`` (``sha256sum -c`` reads it)."""
    sums = dist / "SHA256SUMS"
    lines = [f"{sha256(path)}  {path.relative_to(dist).as_posix()}"
             for path in sorted(dist.rglob("*")) if path.is_file() and path != sums]
    sums.write_text("\n".join(lines) + "\n")
    return sums


PROVENANCE_PREDICATE = "https://slsa.dev/provenance/v1"
BUILD_TYPE = f"{SOURCE_URL}/blob/main/e2e/release/artifacts.py#build"
"""What ``buildDefinition`` means: this module's ``build`` (its parameters below)."""


def provenance(plan: Plan, dist: Path, *, image: bool, started: str, finished: str,
               tools: Mapping[str, str]) -> dict[str, Any]:
    """A SLSA v1 provenance predicate of this build, from what the release step knows: the
    commit and the tree's state, how it was asked for, who built it with what, and every
    artifact's digest (cosign makes it an in-toto statement about the image or chart)."""
    source = f"git+{SOURCE_URL}"
    return {
        "buildDefinition": {
            "buildType": BUILD_TYPE,
            "externalParameters": {
                "source": {"uri": source, "digest": {"gitCommit": plan.revision}},
                "version": plan.version, "image": image},
            "internalParameters": {
                "snapshot": plan.snapshot, "treeState": plan.tree_state,
                "changedPaths": list(plan.changed), "pythonVersion": plan.python},
            "resolvedDependencies": [
                {"uri": f"{source}@{plan.revision}", "digest": {"gitCommit": plan.revision}}],
        },
        "runDetails": {
            "builder": {"id": os.environ.get("ROTA_BUILDER_ID", BUILD_TYPE),
                        "version": dict(sorted(tools.items()))},
            "metadata": {"invocationId": f"{plan.revision}/{plan.version}",
                         "startedOn": started, "finishedOn": finished},
            "byproducts": [{"name": p.relative_to(dist).as_posix(),
                            "digest": {"sha256": sha256(p)}}
                           for p in sorted(dist.rglob("*")) if p.is_file()],
        },
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def release(repo: Path, dist: Path, version: str | None, *, image: bool) -> list[Path]:
    """Build every artifact of a release or a snapshot (:func:`release_plan`) into ``dist``
    (emptied first); their paths."""
    plan = release_plan(repo, version)
    helm = helm_binary()
    started = _now()
    shutil.rmtree(dist, ignore_errors=True)
    dist.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="rota-release-") as tmp:
        scratch = Path(tmp)
        source = stage_source(repo, scratch / "src", plan.python)
        epoch = _git(repo, "show", "-s", "--format=%ct", plan.revision)
        wheel, _ = build_python(source, dist, epoch)
        wheel_sbom(wheel, dist / f"{wheel.name.removesuffix('-py3-none-any.whl')}.wheel.cdx.json",
                   source, scratch)
        build_krew(dist, plan.version, plan.python)
        digest = None
        if image:
            digest, _ = build_image(repo, wheel, dist, plan.version, plan.revision)
        package_chart(stage_chart(repo, scratch, plan.version, digest), dist, helm)
    tools = {"python": sys.version.split()[0],
             "helm": _run([str(helm), "version", "--short"]).strip()}
    predicate = provenance(plan, dist, image=image, started=started, finished=_now(),
                           tools=tools)
    (dist / f"rota-{plan.version}.provenance.json").write_text(
        json.dumps(predicate, indent=2) + "\n")
    write_sums(dist)
    return sorted(p for p in dist.rglob("*") if p.is_file())


def build_main(args: argparse.Namespace) -> int:
    started = time.monotonic()
    built = release(args.repo.resolve(), args.dist.resolve(), args.version or None,
                    image=not args.no_image)
    for path in built:
        print(path)
    print(f"release built in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


def push_main(args: argparse.Namespace) -> int:
    from e2e.release.publish import Target, Tools, install_hint, push

    key = Path(args.key) if args.key else None
    if key is None and not args.unsigned:
        raise ReleaseError("give the cosign key to sign with: SIGNING_KEY=<cosign.key> "
                           "(--key, or ROTA_SIGNING_KEY; cosign generate-key-pair makes "
                           "one), or UNSIGNED=1 (--unsigned) to push without signatures")
    target = Target(args.registry, plain_http=args.plain_http)
    done = push(args.dist.resolve(), target, key, Tools.find())
    if done.image is not None:
        print(f"{target.image(done.version)}@{done.image}")
    print(f"{target.chart(done.version)}@{done.chart}")
    print(("signed and attested with " + str(key)) if done.signed else "NOT signed",
          file=sys.stderr)
    print(install_hint(target, done.version), file=sys.stderr)
    return 0


def verify_main(args: argparse.Namespace) -> int:
    from e2e.release.publish import Target, cosign_binary, verify

    if not args.public_key:
        raise ReleaseError("give the public key: PUBLIC_KEY=<cosign.pub> (--public-key)")
    version = args.version or _dist_version(args.dist)
    target = Target(args.registry, plain_http=args.plain_http)
    done = verify(target, version, Path(args.public_key), cosign_binary(),
                  image=not args.no_image)
    if done.image is not None:
        print(f"verified {target.image(version)}@{done.image}")
    print(f"verified {target.chart(version)}@{done.chart}")
    print(f"built from {done.revision} ({done.tree_state} tree)")
    return 0


def _dist_version(dist: Path) -> str:
    from e2e.release.publish import chart_version

    charts = sorted(dist.glob("rota-*.tgz"))
    if len(charts) != 1:
        raise ReleaseError("give the version to verify: VERSION=<v> (--version)")
    return chart_version(charts[0])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m e2e.release", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    build = commands.add_parser("build", help="build a release or a snapshot into dist/")
    build.add_argument("--version", default="",
                       help="SemVer of a release (default: a snapshot of the commit, or the "
                            "release HEAD is tagged as)")
    build.add_argument("--dist", type=Path, default=REPO / "dist")
    build.add_argument("--repo", type=Path, default=REPO)
    build.add_argument("--no-image", action="store_true",
                       help="leave out the image (and the chart's digest pin)")
    build.set_defaults(run=build_main)
    for name, run in (("push", push_main), ("verify", verify_main)):
        sub = commands.add_parser(name, help=f"{name} dist/'s image and chart (a registry)")
        sub.add_argument("--registry", required=True,
                         help="host[:port]/path: the image goes to <registry>/rota, the "
                              "chart to oci://<registry>/charts/rota")
        sub.add_argument("--dist", type=Path, default=REPO / "dist")
        sub.add_argument("--plain-http", action="store_true",
                         help="the registry speaks HTTP, not HTTPS")
        sub.set_defaults(run=run)
    push_cmd, verify_cmd = commands.choices["push"], commands.choices["verify"]
    push_cmd.add_argument("--key", default=os.environ.get("ROTA_SIGNING_KEY", ""),
                          help="cosign private key file (env ROTA_SIGNING_KEY; its password "
                               "in COSIGN_PASSWORD)")
    push_cmd.add_argument("--unsigned", action="store_true", help="push without signing")
    verify_cmd.add_argument("--public-key", default="", help="cosign public key file")
    verify_cmd.add_argument("--version", default="",
                            help="the version to verify (default: dist/'s chart's)")
    verify_cmd.add_argument("--no-image", action="store_true",
                            help="a release built without an image: the chart only")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return int(args.run(args))
    except ReleaseError as error:
        print(f"release {args.command}: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    # Through the importable module, so e2e.release.publish's ReleaseError is main's own.
    from e2e.release.artifacts import main as _main

    sys.exit(_main())
