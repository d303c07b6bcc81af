"""docs/install.md's "Getting rota's image and chart", run as written in a clone of this
checkout as it is: ``make release`` builds a snapshot of the commit (no VERSION, no
CHANGELOG section, no tag), ``cosign generate-key-pair`` makes a throwaway key,
``make push`` puts the image and the chart into a registry on the loopback address, signed
and attested, and the verification lines accept them; another key, a chart pushed over the
signed one and an image pushed over it are refused.

The registry's name in the docs, ``registry.example.com/platform``, is the loopback
registry's address here, and ``PLAIN_HTTP=1`` is added to ``make`` (it has no TLS).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from e2e.release.registry import LocalRegistry
from tests.docs.blocks import ROOT, blocks_of
from tests.release.releases import (
    COSIGN_ENV,
    IMAGE_BUILDS,
    Release,
    clone,
    git,
    make,
    make_snapshot,
    push_tampered_chart,
)

pytestmark = [pytest.mark.slow, pytest.mark.sampled]

DOC_REGISTRY = "registry.example.com/platform"
NO_PASSWORD = COSIGN_ENV


def _doc_lines(starts: str) -> list[str]:
    """The command lines of install.md's block whose first line starts with ``starts``."""
    for block in blocks_of(ROOT / "docs" / "install.md"):
        if block.is_commands and block.text.startswith(starts):
            return [line for line in block.text.splitlines() if line.strip()]
    raise AssertionError(f"docs/install.md has no command block starting {starts!r}")


@dataclass
class Published:
    snapshot: Release
    registry: LocalRegistry
    cosign: Path

    @property
    def target(self) -> str:
        return f"{self.registry.address}/rota-dev"

    def run(self, line: str, *, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
        """One doc line, its registry and version this test's; make's own virtualenv."""
        words = [w.replace(DOC_REGISTRY, self.target).replace("<version>",
                                                              self.snapshot.version)
                 for w in shlex.split(line)]
        repo = self.snapshot.clone
        if words[0] == "make":
            extra = [] if IMAGE_BUILDS else ["IMAGE=0"]
            return make(repo, *words[1:], "PLAIN_HTTP=1", *extra, env=NO_PASSWORD)
        assert words[0] == "cosign", line
        return subprocess.run([str(self.cosign), *words[1:]], cwd=cwd or repo,
                              capture_output=True, text=True, check=False, timeout=300,
                              env={**os.environ, **NO_PASSWORD})

    def crane(self, *args: str) -> str:
        done = subprocess.run([self.registry.crane, *args, "--insecure"], capture_output=True,
                              text=True, check=False, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    def verify(self) -> list[subprocess.CompletedProcess[str]]:
        lines = _doc_lines("make verify")
        if not IMAGE_BUILDS:
            lines = [line for line in lines if "/rota:" not in line]
        return [self.run(line) for line in lines]


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Published]:
    root = tmp_path_factory.mktemp("publish")
    repo = clone(root / "rota")
    make_line, keygen, push_line = _doc_lines("make release")
    assert shlex.split(make_line) == ["make", "release"]
    snapshot = make_snapshot(repo)
    from e2e.release.publish import cosign_binary  # built on first use, after the release

    with LocalRegistry(root / "data") as registry:
        pub = Published(snapshot, registry, cosign_binary())
        generated = pub.run(keygen)
        assert generated.returncode == 0, generated.stderr
        pushed = pub.run(push_line)
        assert pushed.returncode == 0, pushed.stdout[-3000:] + pushed.stderr[-3000:]
        yield pub


def test_make_release_on_an_untagged_commit_builds_a_snapshot_of_it(
        published: Published) -> None:
    snap = published.snapshot
    assert git(snap.clone, "tag", "--points-at", "HEAD") == ""
    assert snap.version.startswith("0.1.0-dev.")
    assert snap.version.endswith(f".g{snap.revision[:12]}")
    predicate = json.loads(snap.one("rota-*.provenance.json").read_text())
    definition = predicate["buildDefinition"]
    assert definition["externalParameters"]["source"]["digest"]["gitCommit"] == snap.revision
    assert definition["internalParameters"]["snapshot"] is True
    assert definition["internalParameters"]["treeState"] == "clean"
    (wheel,) = snap.dist.glob("rota-*.whl")
    assert wheel.name.startswith("rota-0.1.0.dev")
    assert f"+g{snap.revision[:12]}" in wheel.name
    if IMAGE_BUILDS:
        assert snap.one("rota-image-*.oci.tar").name == f"rota-image-{snap.version}.oci.tar"


def test_push_puts_the_image_and_the_chart_where_the_docs_say(published: Published) -> None:
    version = published.snapshot.version
    repositories = ["rota-dev/charts/rota", *(["rota-dev/rota"] if IMAGE_BUILDS else [])]
    for repository in repositories:
        tags = published.registry.tags(repository)
        assert [t for t in tags if not t.startswith("sha256-")] == [version]
        # cosign's signature and attestation, named after the digest they sign
        digest = published.crane("digest", f"{published.registry.address}/{repository}:"
                                           f"{version}")
        signed = digest.replace(":", "-")
        assert sorted(t for t in tags if t.startswith("sha256-")) == [f"{signed}.att",
                                                                       f"{signed}.sig"]
    if not IMAGE_BUILDS:
        assert published.registry.tags("rota-dev/rota") == []


def test_the_docs_verification_accepts_what_was_pushed(published: Published) -> None:
    for done in published.verify():
        assert done.returncode == 0, [*done.args[:3], done.stdout[-2000:], done.stderr[-3000:]]
    (made, *_) = published.verify()
    assert f"built from {published.snapshot.revision} (clean tree)" in made.stdout


def test_another_key_is_refused(published: Published, tmp_path: Path) -> None:
    keygen = _doc_lines("make release")[1]
    assert published.run(keygen, cwd=tmp_path).returncode == 0
    other = f"PUBLIC_KEY={tmp_path / 'cosign.pub'}"
    line = _doc_lines("make verify")[0].replace("PUBLIC_KEY=cosign.pub", other)
    done = published.run(line)
    assert done.returncode != 0
    assert "verif" in done.stderr.lower()


def _refused(published: Published, ref: str) -> None:
    """``make verify`` and the docs' cosign line for ``ref`` refuse it."""
    made, *cosign_lines = published.verify()
    assert made.returncode != 0, f"make verify accepted a tampered {ref}"
    assert "signature" in made.stderr.lower(), made.stderr[-2000:]
    (line,) = [d for d in cosign_lines if d.args[-1] == f"{ref}:{published.snapshot.version}"
               and d.args[1] == "verify"]
    assert line.returncode != 0, f"cosign verify accepted a tampered {ref}"


def test_a_chart_pushed_over_the_signed_one_is_refused(published: Published,
                                                       tmp_path: Path) -> None:
    snap, version = published.snapshot, published.snapshot.version
    ref = f"{published.target}/charts/rota"
    signed = published.crane("digest", f"{ref}:{version}")
    push_tampered_chart(snap.one("rota-*.tgz"), f"oci://{published.target}/charts", tmp_path)
    assert published.crane("digest", f"{ref}:{version}") != signed
    try:
        _refused(published, ref)
    finally:
        published.crane("tag", f"{ref}@{signed}", version)
    assert all(d.returncode == 0 for d in published.verify())


@pytest.mark.skipif(not IMAGE_BUILDS, reason="the release image needs root and gcc")
def test_an_image_pushed_over_the_signed_one_is_refused(published: Published) -> None:
    version = published.snapshot.version
    ref = f"{published.target}/rota"
    signed = published.crane("digest", f"{ref}:{version}")
    published.crane("mutate", f"{ref}:{version}", "--label", "tampered=yes",
                    "-t", f"{ref}:{version}")
    assert published.crane("digest", f"{ref}:{version}") != signed
    try:
        _refused(published, ref)
    finally:
        published.crane("tag", f"{ref}@{signed}", version)
    assert all(d.returncode == 0 for d in published.verify())


def test_push_refuses_to_sign_nothing_without_being_told(published: Published) -> None:
    push_line = _doc_lines("make release")[2]
    done = published.run(push_line.replace("SIGNING_KEY=cosign.key", ""))
    assert done.returncode != 0
    assert "SIGNING_KEY" in done.stderr
    assert "UNSIGNED=1" in done.stderr
