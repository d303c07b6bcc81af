"""Every object the chart renders, with the least an install sets, with the values of
``manifests/`` and with two other value sets, is accepted by the real API server: a
server-side apply with ``dryRun=All`` runs validation, defaulting and admission (the
ValidatingAdmissionPolicies' CEL included) and stores nothing.

The prometheus-operator kinds (ServiceMonitor, PodMonitor, PrometheusRule) are served here
by stand-in CRDs with an open schema, so for them only the envelope is checked; the rules
themselves go through promtool (test_rules.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, dynamic

from e2e.harness.waiting import eventually
from e2e.release.chart import CHART, Rendered, render
from tests.chart.minimal import ENGINE_NAMESPACE, MINIMAL

pytestmark = pytest.mark.cluster

VALUE_SETS: list[tuple[str, str, str, list[Path], dict[str, str]]] = [
    # id, release, namespace, values files, --set values
    ("default", "rota", "rota-system", [], MINIMAL),
    ("hardened", "prod", "rota-prod", [CHART / "ci" / "hardened-values.yaml"], {}),
    ("monitoring", "rota", "rota-system", [CHART / "ci" / "monitoring-values.yaml"], MINIMAL),
    ("manifests", "rota", "rota-system", [CHART / "ci" / "manifests-values.yaml"], {}),
]
MONITORING_KINDS = (("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors"),
                    ("PrometheusRule", "prometheusrules"))


def _stand_in_crd(kind: str, plural: str) -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.monitoring.coreos.com"},
        "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
                 "names": {"kind": kind, "plural": plural, "singular": kind.lower(),
                           "listKind": f"{kind}List"},
                 "versions": [{"name": "v1", "served": True, "storage": True, "schema": {
                     "openAPIV3Schema": {"type": "object",
                                         "x-kubernetes-preserve-unknown-fields": True}}}]},
    }


@pytest.fixture(scope="module")
def dyn(kube_api: client.ApiClient) -> dynamic.DynamicClient:
    extensions = client.ApiextensionsV1Api(kube_api)
    for kind, plural in MONITORING_KINDS:
        try:
            extensions.create_custom_resource_definition(_stand_in_crd(kind, plural))
        except client.ApiException as exc:
            if exc.status != 409:
                raise

    def established() -> bool:
        return all(any(c.type == "Established" and c.status == "True" for c in
                       extensions.read_custom_resource_definition(
                           f"{plural}.monitoring.coreos.com").status.conditions or [])
                   for _, plural in MONITORING_KINDS)

    eventually(established, timeout=60, what="the stand-in monitoring CRDs established")
    core = client.CoreV1Api(kube_api)
    for ns in ("rota-system", "rota-prod", "rota-monitored", "team-a", "team-b",
               ENGINE_NAMESPACE):
        try:
            core.create_namespace({"metadata": {"name": ns}})
        except client.ApiException as exc:
            if exc.status != 409:
                raise
    return dynamic.DynamicClient(kube_api)


@pytest.mark.parametrize(("release", "namespace", "values", "sets"),
                         [v[1:] for v in VALUE_SETS], ids=[v[0] for v in VALUE_SETS])
def test_rendered_objects_are_accepted(dyn: dynamic.DynamicClient, chart_bin: Path,
                                       release: str, namespace: str,
                                       values: list[Path], sets: dict[str, str]) -> None:
    rendered: Rendered = render(values_files=values, set_values=sets, release=release,
                                namespace=namespace, bin_dir=chart_bin)
    docs = rendered.documents()
    assert len(docs) > 15
    refused = [problem for doc in docs if (problem := _dry_run_apply(dyn, doc))]
    assert not refused


def _dry_run_apply(dyn: dynamic.DynamicClient, doc: dict[str, Any]) -> str:
    """Server-side apply with dryRun=All and strict field validation (an unknown or
    duplicated field is an error, not a warning); the refusal, or an empty string."""
    resource = dyn.resources.get(api_version=doc["apiVersion"], kind=doc["kind"])
    path = resource.path(name=doc["metadata"]["name"],
                         namespace=doc["metadata"].get("namespace"))
    api = dyn.client
    request = api.param_serialize(
        "PATCH", path, body=doc, auth_settings=["BearerToken"],
        query_params=[("dryRun", "All"), ("fieldManager", "rota-chart-test"),
                      ("force", "true"), ("fieldValidation", "Strict")],
        header_params={"Content-Type": "application/apply-patch+yaml",
                       "Accept": "application/json"})
    answer = api.call_api(*request, _request_timeout=30)
    if 200 <= answer.status <= 299:
        return ""
    answer.read()
    return f"{doc['kind']}/{doc['metadata']['name']}: {answer.data.decode(errors='replace')}"


def test_the_dry_run_refuses_what_the_api_server_would(dyn: dynamic.DynamicClient,
                                                       chart_bin: Path) -> None:
    [daemonset] = render(set_values=MINIMAL, bin_dir=chart_bin).find("DaemonSet",
                                                                      "rota-controller")
    daemonset["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["timeout"] = 5
    assert "field not declared in schema" in _dry_run_apply(dyn, daemonset)
    [policy] = render(set_values=MINIMAL, bin_dir=chart_bin).find(
        "ValidatingAdmissionPolicy", "rota-driver-resourceslices")
    policy["spec"]["validations"][0]["expression"] = "variables.userNode ="
    assert "compilation failed" in _dry_run_apply(dyn, policy)
