"""Releases of rota built as a release engineer builds them, for the tests that check them
(``tests/release``) and the ones that install them (``tests/node/test_registry_install.py``).

A release is made in a clone of this checkout: the commit a release engineer makes first
(pyproject's version, the CHANGELOG section) and its tag, then ``make release`` with this
checkout's virtualenv. Several versions come from one clone, one release commit after
another. A snapshot is ``make release`` without ``VERSION`` in a clone as it is, as any
user builds one.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import yaml

from e2e.release.artifacts import python_version
from e2e.release.chart import tools_bin
from e2e.release.publish import cosign_binary

REPO = Path(__file__).resolve().parents[2]
GIT_ID = ["-c", "user.name=rota release test", "-c", "user.email=release-test@rota.invalid"]
IMAGE_BUILDS = os.geteuid() == 0 and shutil.which("gcc") is not None
"""Whether this machine can build the release image (the builder needs root and gcc)."""
MAKE_TIMEOUT_S = 1800.0


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", *GIT_ID, "-C", str(repo), *args], check=True,
                          capture_output=True, text=True, timeout=120).stdout.strip()


def clone(dest: Path) -> Path:
    """A clone of this checkout's HEAD at ``dest``."""
    subprocess.run(["git", "clone", "-q", str(REPO), str(dest)], check=True, timeout=300)
    return dest


def prepare_release_commit(repo: Path, version: str) -> None:
    """What a release engineer commits first: the version (one place) and its CHANGELOG."""
    pyproject = repo / "pyproject.toml"
    text, count = re.subn(r'^version = ".*"$', f'version = "{python_version(version)}"',
                          pyproject.read_text(), count=1, flags=re.MULTILINE)
    if count != 1:
        raise AssertionError("pyproject.toml has no version line")
    pyproject.write_text(text)
    changelog = repo / "CHANGELOG.md"
    changelog.write_text(changelog.read_text().replace(
        "## Unreleased", f"## [{version}]\n\nA release made by the release test.\n\n"
                         "## Unreleased", 1))
    git(repo, "commit", "-q", "-am", f"Release {version}")
    git(repo, "tag", "-a", f"v{version}", "-m", f"rota {version}")


class Release:
    """One built release: the clone's commit it was built from and its ``dist``."""

    def __init__(self, repo: Path, dist: Path, version: str) -> None:
        self.clone = repo
        self.dist = dist
        self.version = version
        self.revision = git(repo, "rev-parse", "HEAD")

    def one(self, pattern: str) -> Path:
        (path,) = self.dist.glob(pattern)
        return path


def make(repo: Path, *args: str, timeout_s: float = MAKE_TIMEOUT_S,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``make -C repo <args>`` with this checkout's virtualenv, as a user runs it."""
    venv = Path(sys.prefix)
    # This checkout's virtualenv (-o: make takes it as installed, as it is).
    argv = ["make", "-C", str(repo), *args, f"VENV={venv}", "-o", str(venv / ".installed")]
    return subprocess.run(argv, env={**os.environ, "ROTA_CHART_TOOLS_BIN": str(tools_bin()),
                                     **(env or {})},
                          capture_output=True, text=True, check=False, timeout=timeout_s)


def make_release(repo: Path, version: str, *, image: bool = IMAGE_BUILDS) -> Release:
    """Commit and tag ``version`` in ``repo`` (a clone) and ``make release`` it; the
    release's ``dist`` is moved to ``repo/../dist-<version>`` so the next version keeps it."""
    prepare_release_commit(repo, version)
    done = make(repo, "release", f"VERSION={version}", f"IMAGE={1 if image else 0}")
    if done.returncode != 0:
        raise AssertionError(f"make release VERSION={version} failed:\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    built = Release(repo, repo / "dist", version)
    kept = repo.parent / f"dist-{version}"
    shutil.move(built.dist, kept)
    built.dist = kept
    return built


def make_snapshot(repo: Path, *, image: bool = IMAGE_BUILDS) -> Release:
    """``make release`` without ``VERSION`` in ``repo`` as it is: a snapshot, left in
    ``repo/dist`` for ``make push``; its version read from the chart it built."""
    done = make(repo, "release", f"IMAGE={1 if image else 0}")
    if done.returncode != 0:
        raise AssertionError(f"make release (a snapshot) failed:\n"
                             f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}")
    return snapshot_in(repo)


def snapshot_in(repo: Path) -> Release:
    """The snapshot ``make release`` left in ``repo/dist``, its version read from its chart."""
    (chart,) = (repo / "dist").glob("rota-*.tgz")
    return Release(repo, repo / "dist", chart.name.removeprefix("rota-").removesuffix(".tgz"))


COSIGN_ENV = {"COSIGN_PASSWORD": "",
              # cosign looks for sigstore's public TUF root first (and goes on without it
              # for a key): here it meets a closed loopback port, never the network
              "HTTPS_PROXY": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9",
              "NO_PROXY": "127.0.0.1,localhost"}
"""The environment of cosign in the tests: a throwaway key without a password."""


def cosign_key_pair(directory: Path) -> Path:
    """``cosign generate-key-pair`` in ``directory``: ``cosign.key`` (no password) and
    ``cosign.pub``, the tests' throwaway signing key; the directory."""
    subprocess.run([str(cosign_binary()), "generate-key-pair"], cwd=directory, check=True,
                   capture_output=True, timeout=120, env={**os.environ, **COSIGN_ENV})
    return directory


def make_at(repo: Path, registry: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``make <args> REGISTRY=<registry> PLAIN_HTTP=1`` in ``repo`` (a clone), as
    docs/install.md pushes to and verifies at a registry without TLS; cosign's password
    empty (the throwaway key's)."""
    return make(repo, *args, f"REGISTRY={registry}", "PLAIN_HTTP=1", env=COSIGN_ENV,
                timeout_s=600)


def push_signed(repo: Path, registry: str, keys: Path, *, dist: Path | None = None) -> None:
    """docs/install.md's ``make push`` of ``dist`` (``repo/dist`` when None, as the docs
    leave it), signed with ``keys``' ``cosign.key``; it must pass."""
    where = [f"DIST={dist}"] if dist is not None else []
    pushed = make_at(repo, registry, "push", f"SIGNING_KEY={keys / 'cosign.key'}", *where)
    assert pushed.returncode == 0, pushed.stdout[-2000:] + pushed.stderr[-3000:]


def verify_signed(repo: Path, registry: str, version: str,
                  keys: Path) -> subprocess.CompletedProcess[str]:
    """docs/install.md's ``make verify`` of ``version`` with ``keys``' ``cosign.pub``."""
    return make_at(repo, registry, "verify", f"VERSION={version}",
                   f"PUBLIC_KEY={keys / 'cosign.pub'}")


def push_tampered_chart(package: Path, chart_url: str, scratch: Path) -> None:
    """An attacker's chart pushed over ``package``'s in the registry: the same name and
    version, its image pinned to another digest."""
    with tarfile.open(package) as tar:
        tar.extractall(scratch, filter="data")
    values = scratch / "rota" / "values.yaml"
    parsed = yaml.safe_load(values.read_text())
    parsed["image"]["digest"] = "sha256:" + "0" * 64
    values.write_text(yaml.safe_dump(parsed))
    helm = str(tools_bin() / "helm")
    out = scratch / "tampered"
    subprocess.run([helm, "package", str(scratch / "rota"), "-d", str(out)], check=True,
                   capture_output=True, timeout=120)
    (tampered,) = out.glob("*.tgz")
    subprocess.run([helm, "push", str(tampered), chart_url, "--plain-http"], check=True,
                   capture_output=True, timeout=120)
