"""A built release (``dist/``) pushed to an OCI registry, signed, and verified there.

``python -m e2e.release push`` and ``verify`` (``make push``, ``make verify``) run this.
``REGISTRY`` is a registry and a path below it (``registry.example.com/platform``); a
release's image goes to ``<REGISTRY>/rota:<v>`` and its chart to ``<REGISTRY>/charts/rota``
(``helm install rota oci://<REGISTRY>/charts/rota --version <v>``).

- :func:`push` checks ``SHA256SUMS`` first (what is pushed is what was built), then
  ``crane push``-es the image's OCI layout (the manifest's bytes, so its digest, are the
  archive's: the digest the chart pins), ``helm push``-es the chart, and with a cosign key
  file signs both by digest (``cosign sign``) and attests the build's provenance to both
  (``cosign attest --type slsaprovenance1``). Signatures stay in the registry, beside what
  they sign; none goes to a public transparency log (``--tlog-upload=false``): a key pair
  of the admin's is the trust, as with the NVIDIA DRA driver's signed chart.
- :func:`verify` is what an admin runs before installing: ``cosign verify`` and
  ``cosign verify-attestation`` of the image and the chart by tag with the public key; a
  tag that now names anything else (a re-pushed image or chart) has no signature and is
  refused. It also checks that both attestations name the version asked for and one commit.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import tarfile
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from e2e.release.artifacts import ReleaseError, helm_binary, sha256
from e2e.release.toolchain import tool_dir

ROOT = Path(__file__).resolve().parents[2]
COSIGN_SCRIPT = ROOT / "e2e" / "toolchain" / "build-cosign.sh"
REGISTRY_SCRIPT = ROOT / "e2e" / "toolchain" / "build-registry.sh"
PREDICATE_TYPE = "slsaprovenance1"
"""cosign's name for ``https://slsa.dev/provenance/v1``."""
TOOL_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Tools:
    """crane (pushes the image), helm (the chart), cosign (signs and verifies)."""

    crane: Path
    helm: Path
    cosign: Path

    @classmethod
    def find(cls) -> Tools:
        """From ``ROTA_REGISTRY_TOOLS_BIN``, ``ROTA_CHART_TOOLS_BIN``, ``ROTA_COSIGN_BIN``
        (directories), else built from the Go module proxy."""
        crane = tool_dir("ROTA_REGISTRY_TOOLS_BIN", REGISTRY_SCRIPT, error=ReleaseError)
        return cls(crane=crane / "crane",
                   helm=helm_binary(), cosign=cosign_binary())


def cosign_binary() -> Path:
    """cosign from ``ROTA_COSIGN_BIN`` (a directory), else built from the Go module proxy."""
    return tool_dir("ROTA_COSIGN_BIN", COSIGN_SCRIPT, error=ReleaseError) / "cosign"


@dataclass(frozen=True)
class Target:
    """Where a release goes: ``registry`` is ``host[:port]/path``."""

    registry: str
    plain_http: bool = False

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9.\-\[\]:]+(/[a-z0-9._\-]+)*", self.registry) \
                or "://" in self.registry:
            raise ReleaseError(f"REGISTRY {self.registry!r} is not host[:port][/path] "
                               f"(no scheme, no tag): e.g. registry.example.com/platform")

    def image(self, version: str) -> str:
        return f"{self.registry}/rota:{version}"

    def chart(self, version: str) -> str:
        return f"{self.registry}/charts/rota:{version}"

    @property
    def chart_url(self) -> str:
        """``helm push``'s target; the chart is ``<chart_url>/rota``."""
        return f"oci://{self.registry}/charts"

    def cosign_flags(self) -> list[str]:
        return ["--allow-http-registry", "--allow-insecure-registry"] if self.plain_http else []


@dataclass(frozen=True)
class Built:
    """What ``dist`` holds for one release or snapshot."""

    version: str
    chart: Path
    image: Path | None
    provenance: Path


@dataclass(frozen=True)
class Published:
    """Digests in the registry: the image (None when the build had none) and the chart."""

    version: str
    image: str | None
    chart: str
    signed: bool


def _run(argv: Sequence[str | Path], *, env: Mapping[str, str] | None = None,
         with_stderr: bool = False) -> str:
    """``argv``'s stdout (and stderr, ``with_stderr``); a ReleaseError if it failed."""
    done = subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          check=False, timeout=TOOL_TIMEOUT_S, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise ReleaseError(f"{Path(str(argv[0])).name} {' '.join(str(a) for a in argv[1:3])} "
                           f"exited {done.returncode}:\n{done.stdout[-2000:]}\n"
                           f"{done.stderr[-3000:]}")
    return done.stdout + done.stderr if with_stderr else done.stdout


def check_sums(dist: Path) -> None:
    """Every file ``SHA256SUMS`` names has its digest, and no other file is there."""
    sums = dist / "SHA256SUMS"
    if not sums.is_file():
        raise ReleaseError(f"{dist} has no SHA256SUMS: build it first (make release)")
    listed: dict[str, str] = {}
    for line in filter(None, sums.read_text().splitlines()):
        digest, name = line.split("  ", 1)
        listed[name] = digest
    files = {p.relative_to(dist).as_posix() for p in dist.rglob("*")
             if p.is_file() and p != sums}
    if set(listed) != files:
        raise ReleaseError(f"{dist} differs from its SHA256SUMS: "
                           f"{sorted(set(listed) ^ files)}")
    for name, digest in listed.items():
        if sha256(dist / name) != digest:
            raise ReleaseError(f"{dist / name} is not the file SHA256SUMS names")


def read_dist(dist: Path) -> Built:
    """The release in ``dist``, its sums checked."""
    check_sums(dist)
    charts = sorted(dist.glob("rota-*.tgz"))
    if len(charts) != 1:
        raise ReleaseError(f"{dist} holds {len(charts)} charts, not one: build it again")
    version = chart_version(charts[0])
    image = dist / f"rota-image-{version}.oci.tar"
    provenance = dist / f"rota-{version}.provenance.json"
    if not provenance.is_file():
        raise ReleaseError(f"{dist} has no {provenance.name}: build it again (make release)")
    return Built(version, charts[0], image if image.is_file() else None, provenance)


def chart_version(package: Path) -> str:
    with tarfile.open(package) as tar:
        handle = tar.extractfile("rota/Chart.yaml")
        if handle is None:
            raise ReleaseError(f"{package} has no rota/Chart.yaml")
        return str(yaml.safe_load(handle)["version"])


def push_image(archive: Path, ref: str, target: Target, crane: Path) -> str:
    """``crane push`` the archive's one image as ``ref``; the registry's digest of it,
    refused unless it is the archive's."""
    with tempfile.TemporaryDirectory(prefix="rota-layout-") as tmp:
        layout = Path(tmp)
        with tarfile.open(archive) as tar:
            tar.extractall(layout, filter="data")
        (entry,) = json.loads((layout / "index.json").read_text())["manifests"]
        insecure = ["--insecure"] if target.plain_http else []
        _run([crane, "push", *insecure, layout, ref])
    pushed = _run([crane, "digest", *insecure, ref]).strip()
    if pushed != entry["digest"]:
        raise ReleaseError(f"{ref} is {pushed}, the archive's image is {entry['digest']}")
    return pushed


def push_chart(package: Path, target: Target, helm: Path) -> str:
    """``helm push`` the chart below ``target.chart_url``; its digest."""
    plain = ["--plain-http"] if target.plain_http else []
    out = _run([helm, "push", package, target.chart_url, *plain], with_stderr=True)
    found = re.search(r"Digest:\s*(sha256:[0-9a-f]{64})", out)
    if found is None:
        raise ReleaseError(f"helm push named no digest:\n{out}")
    return found.group(1)


def sign(ref: str, digest: str, key: Path, provenance: Path, target: Target,
         cosign: Path) -> None:
    """Sign ``ref``'s ``digest`` with the key file and attest the provenance to it."""
    pinned = f"{ref.rsplit(':', 1)[0]}@{digest}"
    common: list[str | Path] = ["--key", key, "--tlog-upload=false", "--yes",
                                *target.cosign_flags()]
    _run([cosign, "sign", *common, pinned])
    _run([cosign, "attest", *common, "--type", PREDICATE_TYPE, "--predicate", provenance,
          pinned])


def push(dist: Path, target: Target, key: Path | None, tools: Tools) -> Published:
    """Push ``dist``'s image and chart to ``target``; signed and attested with ``key``."""
    built = read_dist(dist)
    if key is not None and not key.is_file():
        raise ReleaseError(f"no signing key at {key} (cosign generate-key-pair makes one)")
    image = None
    if built.image is not None:
        image = push_image(built.image, target.image(built.version), target, tools.crane)
    chart = push_chart(built.chart, target, tools.helm)
    if key is not None:
        if image is not None:
            sign(target.image(built.version), image, key, built.provenance, target,
                 tools.cosign)
        sign(target.chart(built.version), chart, key, built.provenance, target, tools.cosign)
    return Published(built.version, image, chart, signed=key is not None)


def _verified_digest(ref: str, public_key: Path, target: Target, cosign: Path) -> str:
    """``cosign verify`` of ``ref``; the digest its signatures sign."""
    out = _run([cosign, "verify", "--key", public_key, "--insecure-ignore-tlog=true",
                *target.cosign_flags(), "--output", "json", ref])
    digests = {str(item["critical"]["image"]["docker-manifest-digest"])
               for item in json.loads(out)}
    if len(digests) != 1:
        raise ReleaseError(f"{ref}: signatures of {sorted(digests)}, not of one digest")
    return digests.pop()


def _attested(ref: str, public_key: Path, target: Target, cosign: Path) -> dict[str, Any]:
    """``cosign verify-attestation`` of ``ref``'s provenance; the in-toto statement."""
    out = _run([cosign, "verify-attestation", "--key", public_key,
                "--insecure-ignore-tlog=true", "--type", PREDICATE_TYPE,
                *target.cosign_flags(), ref])
    statements = [json.loads(base64.b64decode(json.loads(line)["payload"]))
                  for line in out.splitlines() if line.strip()]
    if not statements:
        raise ReleaseError(f"{ref} has no provenance attestation")
    statement: dict[str, Any] = statements[-1]
    return statement


@dataclass(frozen=True)
class Verified:
    """A release whose signatures and provenance were checked in the registry."""

    version: str
    image: str | None
    chart: str
    revision: str
    tree_state: str


def _revision(statement: Mapping[str, Any], ref: str, version: str) -> tuple[str, str]:
    definition = statement["predicate"]["buildDefinition"]
    if definition["externalParameters"]["version"] != version:
        raise ReleaseError(f"{ref}'s provenance is of version "
                           f"{definition['externalParameters']['version']}, not {version}")
    commit = definition["externalParameters"]["source"]["digest"]["gitCommit"]
    return str(commit), str(definition["internalParameters"]["treeState"])


def verify(target: Target, version: str, public_key: Path, cosign: Path, *,
           image: bool = True) -> Verified:
    """Refuse unless the image (``image``) and the chart of ``version`` in ``target`` carry
    signatures and provenance of ``public_key``'s key, of one commit."""
    if not public_key.is_file():
        raise ReleaseError(f"no public key at {public_key}")
    refs = ([target.image(version)] if image else []) + [target.chart(version)]
    digests = [_verified_digest(ref, public_key, target, cosign) for ref in refs]
    sources = {_revision(_attested(ref, public_key, target, cosign), ref, version)
               for ref in refs}
    if len(sources) != 1:
        raise ReleaseError(f"the image's and the chart's provenance differ: {sorted(sources)}")
    ((revision, state),) = sources
    return Verified(version, digests[0] if image else None, digests[-1], revision, state)


def install_hint(target: Target, version: str) -> str:
    """What an admin runs next, as docs/install.md shows it."""
    plain = " --plain-http" if target.plain_http else ""
    return (f"helm install rota oci://{target.registry}/charts/rota --version {version}{plain} "
            f"\\\n  --namespace rota-system --create-namespace "
            f"--set image.repository={target.registry}/rota --set engineNamespaces={{<ns>}}")

