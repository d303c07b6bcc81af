"""rota installed from an OCI registry, as an admin installs released software: two
releases (``make release``, the image included) pushed to a registry on the loopback
address, ``helm install`` of the first from ``oci://``, a switch through the gateway,
``helm upgrade`` to the second from the registry, a switch again, and ``helm uninstall``.

The node pulls rota's image from the registry (containerd's ``hosts.toml`` for a
plain-HTTP registry; the release image is in no archive the node imports): the pods run
the digest the registry serves, and containerd holds it under the registry's name.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import yaml
from kubernetes import client

from e2e.chart import tools_bin
from e2e.cluster import LocalCluster
from e2e.images import BuiltImages
from e2e.registry import IMAGE_PATH, LocalRegistry
from e2e.waiting import WaitTimeout, eventually
from tests.node.helm import (
    HelmRelease,
    helm_homes,
    helm_stage,
    kubectl,
    switch_to_the_sleeping_model,
)
from tests.real_node import needs_root
from tests.release.releases import IMAGE_BUILDS, Release, clone, make_release

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
    chart: str
    """The chart's ``oci://`` reference in the registry."""
    digests: dict[str, str]
    """Version -> the image digest the registry serves for it."""

    def values(self) -> list[str]:
        return [*self.helm.values(), "--plain-http",
                "--set", f"image.repository={self.registry.address}/{IMAGE_PATH}"]


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Release]:
    repo = clone(tmp_path_factory.mktemp("releases") / "rota")
    return {version: make_release(repo, version) for version in (V1, V2)}


@pytest.fixture(scope="module")
def installed(cluster: LocalCluster, kube_api: client.ApiClient, rota_images: BuiltImages,
              device_class: str, releases: dict[str, Release],
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    root = tmp_path_factory.mktemp("registry")
    with LocalRegistry(root / "data") as registry:
        helm_home = helm_homes(root)
        digests = {v: registry.push_image(r.one("rota-image-*.oci.tar"), v)
                   for v, r in releases.items()}
        charts = {registry.push_chart(r.one("rota-*.tgz"), tools_bin() / "helm", env=helm_home)
                  for r in releases.values()}
        (chart,) = charts
        with helm_stage(cluster, kube_api, rota_images, root=root, node=NODE,
                        node_label=NODE_LABEL, prefix="r",
                        registry_ports=[registry.port]) as rel:
            yield Installed(rel, registry, chart, digests)


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


async def test_install_from_the_registry_and_switch(installed: Installed) -> None:
    assert installed.registry.tags("charts/rota") == [V1, V2]
    rel = installed.helm
    rel.helm("install", rel.name, installed.chart, "--version", V1, *installed.values())
    rel.installed = True
    _wait_running(installed, V1)
    assert installed.digests[V1] in _pulled(installed).values()
    rel.engine_pods = rel.rota.deploy_engines(rel.engines)
    print(f"\ninstalled {V1} from {installed.chart}; switched to {await _switch(installed)}")


async def test_upgrade_from_the_registry_and_switch(installed: Installed) -> None:
    rel = installed.helm
    if not rel.engine_pods:
        pytest.fail("needs the install test's release and engines")
    rel.helm("upgrade", rel.name, installed.chart, "--version", V2, *installed.values())
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
