"""A prepare the driver refuses on budget, on the real node: the kubelet shows it as a
FailedPrepareDynamicResources event on the pod, with the driver's numbers, retries it at
its own pace, and the pod starts once the budget allows. Prints how long the kubelet takes
between attempts (the README quotes it)."""

from __future__ import annotations

import json
import time

import pytest
from kubernetes import client

from e2e.harness.rota_node import RotaOnNodes, engine_docs
from e2e.harness.waiting import eventually
from tests.node.test_claims import ledger
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, needs_root]

REASON = "FailedPrepareDynamicResources"


def _refusals(core: client.CoreV1Api, namespace: str) -> list[client.CoreV1Event]:
    return list(core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name=big,reason={REASON}").items)


@pytest.mark.sampled
def test_a_refused_prepare_is_an_event_and_the_pod_starts_when_the_budget_allows(
        kube_api: client.ApiClient, rota_node: RotaOnNodes, namespace: str) -> None:
    core = client.CoreV1Api(kube_api)
    engines = rota_node.deploy_engines(namespace)  # 2Gi + 1Gi resident
    # 139Gi awake next to 3Gi resident does not fit the H200's 140.4Gi.
    rota_node.deploy_engines(namespace, wait=False, docs=engine_docs(
        "big", model="org/model-big", resident="1Gi", awake="139Gi"))

    def attempts() -> int:
        return sum(e.count or 1 for e in _refusals(core, namespace))

    eventually(lambda: attempts() >= 2, timeout=300, max_interval=2.0,
               what="two refused prepares of pod big")
    (event,) = _refusals(core, namespace)
    assert "needs 139.0 GiB awake" in event.message, event.message
    assert "3.0 GiB resident" in event.message
    assert "has 140.4 GiB: 1.6 GiB short" in event.message
    retry_s = (event.last_timestamp - event.first_timestamp).total_seconds() / max(
        1, (event.count or 1) - 1)
    assert core.read_namespaced_pod("big", namespace).status.phase == "Pending"

    for engine in engines:
        core.delete_namespaced_pod(engine.name, namespace, grace_period_seconds=1)
    names = {e.claim for e in engines}
    eventually(lambda: not {r["name"] for r in ledger(rota_node.node()).values()
                            if r["namespace"] == namespace} & names,
               timeout=120, what="the two engines' claims unprepared")
    freed = time.monotonic()
    eventually(lambda: core.read_namespaced_pod("big", namespace).status.phase == "Running",
               timeout=300, max_interval=2.0, what="pod big running once the budget allows")
    print(json.dumps({"kubelet_prepare_retry_interval_s": round(retry_s, 1),
                      "budget_freed_to_running_s": round(time.monotonic() - freed, 1)}))
