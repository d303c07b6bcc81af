"""rota installed from an OCI registry, as docs/install.md installs it: two releases
(``make release``, the image included) pushed with ``make push`` to a registry on the
loopback address, signed with a throwaway cosign key and attested; ``make verify`` before
``helm install`` of the first from ``oci://``, a switch through the gateway; a chart pushed
over the signed second one is refused by ``make verify`` and not upgraded to; the signed
one back, ``helm upgrade`` to it from the registry, a switch again, and ``helm uninstall``.

The node pulls rota's image from the registry (containerd's ``hosts.toml`` for a
plain-HTTP registry; the release image is in no archive the node imports): the pods run
the digest the registry serves, and containerd holds it under the registry's name.
"""

from __future__ import annotations

import subprocess
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from kubernetes import client

from e2e.cluster import LocalCluster
from e2e.harness.waiting import WaitTimeout, eventually
from e2e.images import BuiltImages
from e2e.release.registry import CHART_PATH, IMAGE_PATH, LocalRegistry
from tests.node.helm import (
    HelmRelease,
    helm_stage,
    kubectl,
    switch_to_the_sleeping_model,
)
from tests.real_node import needs_root
from tests.release.releases import (
    IMAGE_BUILDS,
    Release,
    clone,
    cosign_key_pair,
    make_release,
    push_signed,
    push_tampered_chart,
    verify_signed,
)

pytestmark = [pytest.mark.cluster, pytest.mark.node, needs_root, pytest.mark.slow,
              pytest.mark.sampled,
              pytest.mark.skipif(not IMAGE_BUILDS, reason="the release image needs root and gcc")]

NODE = "rota-registry-node"
NODE_LABEL = "rota.test/registry-node"
V1, V2 = "0.0.0-test.1", "0.0.0-test.2"
COMPONENTS = ("driver", "controller", "gateway")


@dataclass
class Installed:
    helm: HelmRelease
    registry: LocalRegistry
    releases: dict[str, Release]
    keys: Path
    """The directory of the throwaway ``cosign.key`` and ``cosign.pub``."""
    digests: dict[str, str]
    """Version -> the image digest the registry serves for it."""

    @property
    def chart(self) -> str:
        """The chart's ``oci://`` reference in the registry."""
        return self.registry.chart_ref()

    def values(self) -> list[str]:
        return [*self.helm.values(), "--plain-http",
                "--set", f"image.repository={self.registry.address}/{IMAGE_PATH}"]

    def verified_helm(self, command: str, version: str) -> subprocess.CompletedProcess[str]:
        """docs/install.md's order: ``make verify``, and ``helm <command>`` of ``version``
        only when it passed; the verification's result."""
        verified = verify_signed(self.releases[version].clone, self.registry.target, version,
                                 self.keys)
        if verified.returncode == 0:
            self.helm.helm(command, self.helm.name, self.chart, "--version", version,
                           *self.values())
        return verified


def _push(registry: LocalRegistry, release: Release, keys: Path) -> str:
    """docs/install.md's ``make push`` of one release; the image digest the registry has."""
    push_signed(release.clone, registry.target, keys, dist=release.dist)
    return registry.digest(registry.image_ref(release.version))


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Release]:
    repo = clone(tmp_path_factory.mktemp("releases") / "rota")
    return {version: make_release(repo, version) for version in (V1, V2)}


@pytest.fixture(scope="module")
def installed(cluster: LocalCluster, kube_api: client.ApiClient, rota_images: BuiltImages,
              device_class: str, releases: dict[str, Release],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = cosign_key_pair(tmp_path_factory.mktemp("registry"))
    with LocalRegistry(root / "data") as registry:
        digests = {v: _push(registry, built, root) for v, built in releases.items()}
        with helm_stage(cluster, kube_api, rota_images, root=root, node=NODE,
                        node_label=NODE_LABEL, prefix="r",
                        registry_ports=[registry.port]) as rel:
            yield Installed(rel, registry, releases, root, digests)


def _image_ids(installed: Installed) -> set[str]:
    """The imageID of every container of the release's driver, controller and gateway."""
    return {status.image_id for component in COMPONENTS
            for pod in installed.helm.pods(component)
            for status in pod.status.container_statuses or []}


def _wait_running(installed: Installed, version: str) -> None:
    """Every component Ready, and every container on ``version``'s digest."""
    want = {f"{installed.registry.address}/{IMAGE_PATH}@{installed.digests[version]}"}
    rel = installed.helm
    try:
        eventually(lambda: all(len(rel.ready(c)) == 1 and len(rel.pods(c)) == 1
                               for c in COMPONENTS) and _image_ids(installed) == want,
                   timeout=300, max_interval=2.0,
                   what=f"driver, controller and gateway Ready on {version}'s image")
    except WaitTimeout as exc:
        raise AssertionError(
            f"image ids {_image_ids(installed)}, want {want}\n"
            + kubectl(rel, "-n", rel.namespace, "get", "pods", "-o", "wide")
            + kubectl(rel, "-n", rel.namespace, "get", "events")
            + "registry log:\n" + installed.registry.log_tail(40)) from exc


async def _switch(installed: Installed) -> str:
    """Ask the asleep model through the gateway; it answers and then holds the GPU."""
    return await switch_to_the_sleeping_model(installed.helm)


def _pulled(installed: Installed) -> dict[str, str]:
    """containerd's images on the node under the registry's name: ref -> digest."""
    listed = installed.helm.node.ctr("images", "ls")
    assert listed.returncode == 0, listed.stderr
    prefix = f"{installed.registry.address}/{IMAGE_PATH}"
    return {fields[0]: fields[2] for fields in (line.split() for line in
                                                listed.stdout.splitlines()[1:])
            if fields and fields[0].startswith(prefix)}


async def test_install_from_the_registry_after_verifying_it_and_switch(
        installed: Installed) -> None:
    versions = [t for t in installed.registry.tags(f"{CHART_PATH}/rota")
                if not t.startswith("sha256-")]  # cosign's .sig and .att beside them
    assert versions == [V1, V2]
    rel = installed.helm
    verified = installed.verified_helm("install", V1)
    assert verified.returncode == 0, verified.stderr[-3000:]
    rel.installed = True
    _wait_running(installed, V1)
    assert installed.digests[V1] in _pulled(installed).values()
    rel.engine_pods = rel.rota.deploy_engines(rel.engines)
    print(f"\ninstalled {V1} from {installed.chart}; switched to {await _switch(installed)}")


def test_a_chart_pushed_over_the_signed_one_is_not_upgraded_to(
        installed: Installed, tmp_path: Path) -> None:
    rel = installed.helm
    if not rel.installed:
        pytest.fail("needs the install test's release")
    ref = f"{installed.registry.address}/{CHART_PATH}/rota"
    signed = installed.registry.digest(f"{ref}:{V2}")
    history = rel.helm("history", rel.name, "--namespace", rel.namespace).stdout
    push_tampered_chart(installed.releases[V2].one("rota-*.tgz"),
                        f"oci://{installed.registry.address}/{CHART_PATH}", tmp_path)
    assert installed.registry.digest(f"{ref}:{V2}") != signed
    try:
        refused = installed.verified_helm("upgrade", V2)
        assert refused.returncode != 0, "make verify accepted a chart nobody signed"
        assert "signature" in refused.stderr.lower(), refused.stderr[-2000:]
        assert rel.helm("history", rel.name, "--namespace", rel.namespace).stdout == history
    finally:
        subprocess.run([installed.registry.crane, "tag", "--insecure", f"{ref}@{signed}", V2],
                       check=True, capture_output=True, timeout=60)


async def test_upgrade_from_the_registry_after_verifying_it_and_switch(
        installed: Installed) -> None:
    rel = installed.helm
    if not rel.engine_pods:
        pytest.fail("needs the install test's release and engines")
    verified = installed.verified_helm("upgrade", V2)
    assert verified.returncode == 0, verified.stderr[-3000:]
    _wait_running(installed, V2)
    history = rel.helm("history", rel.name, "--namespace", rel.namespace).stdout
    assert f"rota-{V2}" in history
    pulled = _pulled(installed)
    assert installed.digests[V2] in pulled.values()
    print(f"\nupgraded to {V2}; switched to {await _switch(installed)}; "
          f"containerd holds {pulled}")


def test_uninstall(installed: Installed) -> None:
    rel = installed.helm
    rel.helm("uninstall", rel.name, "--namespace", rel.namespace)
    rel.installed = False
    eventually(lambda: not client.CoreV1Api(rel.api).list_namespaced_pod(
        rel.namespace, _request_timeout=10).items, timeout=600, max_interval=2.0,
        what="the release's pods gone")
    listed = rel.helm("list", "--namespace", rel.namespace, "-q").stdout
    assert rel.name not in listed.split()


def test_the_registry_serves_the_digests_the_charts_pin(
        installed: Installed, releases: dict[str, Release]) -> None:
    for version, built in releases.items():
        with tarfile.open(built.one("rota-*.tgz")) as tar:
            handle = tar.extractfile("rota/values.yaml")
            assert handle is not None
            pinned = str(yaml.safe_load(handle)["image"]["digest"])
        assert pinned == installed.digests[version]
