"""Pod URLs work on IPv6 clusters."""

from __future__ import annotations

import pytest
from yarl import URL

from controller.claimants import claimants_from
from controller.lease.engines.base import EngineEndpoint
from controller.urls import advertised_url, http_url, normalize_base_url


@pytest.mark.parametrize(("host", "url"), [
    ("10.0.0.5", "http://10.0.0.5:8000"), ("fd00::5", "http://[fd00::5]:8000"),
    ("[fd00::5]", "http://[fd00::5]:8000"), ("engine.ns.svc", "http://engine.ns.svc:8000"),
    ("::1", "http://[::1]:8000"),
])
def test_urls_of_every_address_family_parse_back_to_their_host(host: str, url: str) -> None:
    built = http_url(host, 8000)
    assert built == url
    assert URL(built).port == 8000
    assert URL(built).host == host.strip("[]")


def test_an_ipv6_pod_gets_a_usable_engine_endpoint() -> None:
    claim = {"metadata": {"uid": "c-1", "namespace": "ns", "name": "model-a"},
             "spec": {"devices": {"config": [{"opaque": {"driver": "gpu.rota.dev", "parameters": {
                 "apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                 "model": "org/a", "awakeMemory": "20Gi"}}}]}},
             "status": {"allocation": {"devices": {"results": [
                 {"driver": "gpu.rota.dev", "pool": "node-1", "device": "gpu-0",
                  "request": "gpu"}]}},
                 "reservedFor": [{"resource": "pods", "name": "pod-a", "uid": "p-1"}]}}
    pod = {"metadata": {"uid": "p-1", "name": "pod-a", "namespace": "ns"},
           "status": {"podIP": "fd00:10::7"}}
    (claimant,) = claimants_from([claim], {"p-1": pod})
    assert claimant.endpoint is not None
    EngineEndpoint(base_url=claimant.endpoint, model="org/a", claim="ns/model-a")
    assert URL(claimant.endpoint).host == "fd00:10::7"


@pytest.mark.parametrize(("listen", "host", "url"), [
    ("::", "fd00::5", "http://[fd00::5]:8090"), ("::", "10.0.0.5", "http://10.0.0.5:8090"),
    ("[::]", None, "http://127.0.0.1:8090"), ("0.0.0.0", None, "http://127.0.0.1:8090"),
    ("", None, "http://127.0.0.1:8090"), ("127.0.0.1", None, "http://127.0.0.1:8090"),
    ("fd00::7", None, "http://[fd00::7]:8090"), ("0.0.0.0", "", "http://127.0.0.1:8090"),
])
def test_the_controller_advertises_its_pod_ip_in_either_family(
        listen: str, host: str | None, url: str) -> None:
    """The chart gives the controller its pod IP (status.podIP), whatever the family;
    the URL brackets an IPv6 one, so no install setting says which family it is."""
    assert advertised_url(listen, 8090, host=host) == url


@pytest.mark.parametrize(("advertised", "usable"), [
    ("http://10.0.0.9:8090/", "http://10.0.0.9:8090"),
    ("http://fd00::9:8090", "http://[fd00::9]:8090"),  # what http://$(POD_IP):8090 gives
    ("http://[fd00::9]:8090", "http://[fd00::9]:8090"),
    ("https://ctl.example:8443/base", "https://ctl.example:8443/base"),
    ("ftp://10.0.0.9:21", None), ("10.0.0.9:8090", None), ("http://:8090", None),
    ("http://fd00::zz:8090", None), ("http://10.0.0.9:99999", None),
])
def test_an_advertised_activation_url_is_made_usable(advertised: str, usable: str | None
                                                     ) -> None:
    assert normalize_base_url(advertised) == usable
