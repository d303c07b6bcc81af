"""``kubectl rota``: status from the Leases as the controller writes them, and a switch
through the activation API of a real lease controller, on the local cluster."""

from __future__ import annotations

import datetime as dt
import io
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from controller.kubectl_rota import (
    find_claimant,
    interpret_activation,
    main,
    render_status,
    render_switch,
    status_json,
    status_rows,
)
from e2e.cluster import LocalCluster
from e2e.cluster.nodes import create_node
from e2e.harness.local_node import GpuNode
from e2e.harness.scenario import Engine
from e2e.harness.waiting import eventually
from rota.api import naming
from rota.api.activation import TOKEN_HEADER, ActivateAnswer
from rota.api.controller_lease import ControllerLease
from rota.api.gpu_lease import AwakeMember, GpuLease, lease_body
from tests.chart.activation_simulator import ActivationApiSimulator, proxyable_address, serving
from tests.engines_on_cluster import MODEL_A, MODEL_B

NOW = dt.datetime(2026, 12, 1, 10, 0, 0, tzinfo=dt.UTC)


def _gpu(ns: str, node: str, device: str, **fields: Any) -> dict[str, Any]:
    lease = GpuLease(name=naming.gpu_lease_name(node, device), node=node, device=device,
                     **fields)
    return lease_body(lease, ns, labels_node=node, labels_device=device)


def _controller(ns: str, node: str, url: str, *, renewed: dt.datetime) -> dict[str, Any]:
    """A controller Lease as controller.lease.election writes it (through its one contract)."""
    return ControllerLease(name=naming.controller_lease_name(node), node=node,
                           holder=f"rota-controller-{node[-4:]}", instance="i-1",
                           activation_url=url, renew_time=renewed,
                           duration_s=15).body(ns)


def _leases(ns: str, now: dt.datetime) -> list[dict[str, Any]]:
    return [
        _gpu(ns, "gpu-node-1", "gpu-0", holder="prod/chat", fence=7,
             state=naming.STATE_AWAKE, holder_model="org/chat", gpu_uuid="GPU-1a2b"),
        _gpu(ns, "gpu-node-1", "gpu-1", fence=3, state=naming.STATE_FAILED,
             last_error="memory_not_returned: prod/embed holds 9.1 GiB asleep"),
        _gpu(ns, "gpu-node-2", "gpu-0", holder="prod/rerank", fence=12,
             state=naming.STATE_SWITCHING, holder_model="org/rerank",
             draining_model="org/rerank", target_model="org/chat-small"),
        _controller(ns, "gpu-node-1", "http://127.0.0.1:9", renewed=now),
        _controller(ns, "gpu-node-2", "http://127.0.0.1:9",
                    renewed=now - dt.timedelta(minutes=5)),
        _controller(ns, "gpu-node-3", "http://127.0.0.1:9",
                    renewed=now + dt.timedelta(seconds=10)),  # its clock 10 s ahead
        _gpu(ns, "gpu-node-3", "gpu-0", fence=1, state=naming.STATE_IDLE),
    ]


def test_status_rows_and_table() -> None:
    state = {"leases": {"gpu-0": {"holder": "prod/chat", "queue": 2, "last_switch": {
        "ok": True, "from": "prod/embed", "to": "prod/chat", "fence": 7,
        "timings": {"total": 2.5, "later_sleep": 0.4, "wake_call": 1.25}}}}}
    rows = status_rows(_leases("rota-system", NOW), {"gpu-node-1": state})
    assert [(r.lease.node, r.gpu, r.lease.state) for r in rows] == [
        ("gpu-node-1", "gpu-0", "awake"), ("gpu-node-1", "gpu-1", "failed"),
        ("gpu-node-2", "gpu-0", "switching"), ("gpu-node-3", "gpu-0", "idle")]
    text = render_status(rows, NOW)
    lines = text.splitlines()
    assert lines[0].split() == ["NODE", "GPU", "STATE", "HOLDER", "MODEL", "FENCE",
                                "CONTROLLER", "CTL-RENEWED", "RENEWED", "QUEUE"]
    assert lines[1].split()[:6] == ["gpu-node-1", "gpu-0", "awake", "prod/chat", "org/chat",
                                    "7"]
    assert lines[1].split()[-1] == "2"
    assert ("last switch: prod/embed -> prod/chat ok in 2.50s [later_sleep 0.40s, "
            "wake_call 1.25s]") in text
    assert "last error: memory_not_returned: prod/embed holds 9.1 GiB asleep" in text
    assert "org/rerank -> org/chat-small" in text
    # No liveness verdict from one read: the renewal as each node's clock stamped it.
    assert "expired" not in text
    def row(node: str) -> list[str]:
        return next(line for line in lines if line.startswith(node)).split()

    assert row("gpu-node-1")[6:8] == ["rota-controller-de-1", "0s/15s"]
    assert row("gpu-node-2")[-4:-2] == ["rota-controller-de-2", "5m/15s"]
    assert row("gpu-node-3")[6:8] == ["rota-controller-de-3", "-10s/15s"]
    assert "One read cannot tell whether a controller is alive" in " ".join(lines)
    assert [r.gpu for r in status_rows(_leases("x", NOW), node="gpu-node-2")] == ["gpu-0"]
    assert "No GPU Leases" in render_status([], NOW)


def test_status_shows_every_member_of_an_awake_set() -> None:
    """The holder in its columns, the engines beside it on a line of their own (also during
    a switch, which they stay awake through), every member in ``-o json``; a one-awake
    GPU's lines are as they were."""
    beside = (AwakeMember("prod/embed", "uid-embed", "org/embed"),
              AwakeMember("prod/rerank", "uid-rerank", "org/rerank"))
    leases = [
        _gpu("x", "gpu-node-1", "gpu-0", holder="prod/chat", fence=7,
             holder_claim_uid="uid-chat", state=naming.STATE_AWAKE,
             holder_model="org/chat", companions=beside),
        _gpu("x", "gpu-node-1", "gpu-1", holder="prod/code", fence=4,
             holder_claim_uid="uid-code", state=naming.STATE_SWITCHING,
             holder_model="org/code", draining_model="org/code",
             target_model="org/chat-small", companions=beside[:1]),
        _gpu("x", "gpu-node-1", "gpu-2", holder="prod/solo", fence=2,
             holder_claim_uid="uid-solo", state=naming.STATE_AWAKE, holder_model="org/solo"),
    ]
    rows = status_rows(leases)
    lines = render_status(rows, NOW).splitlines()
    assert lines[1].split()[:6] == ["gpu-node-1", "gpu-0", "awake", "prod/chat", "org/chat",
                                    "7"]
    assert lines[2].strip() == "awake with: prod/embed (org/embed), prod/rerank (org/rerank)"
    assert lines[3].split()[:4] == ["gpu-node-1", "gpu-1", "switching", "prod/code"]
    assert lines[4].strip() == "awake with: prod/embed (org/embed)"
    assert lines[5].split()[:4] == ["gpu-node-1", "gpu-2", "awake", "prod/solo"]
    assert not any("awake with" in line for line in lines[6:]), "one awake: no such line"
    shown = {r["gpu"]: r for r in status_json(rows, NOW)}
    assert [m["claim"] for m in shown["gpu-0"]["awake_with"]] == ["prod/embed", "prod/rerank"]
    assert shown["gpu-0"]["awake_with"][0] == {"claim": "prod/embed", "uid": "uid-embed",
                                               "model": "org/embed"}
    assert shown["gpu-2"]["awake_with"] == []
    assert shown["gpu-2"]["holder"] == "prod/solo"


def test_activation_answers_are_read_through_the_contract() -> None:
    ok = interpret_activation(200, json.dumps({
        "model": "org/b", "claim": "prod/b", "switched": True, "fence": 9,
        "timings": {"total": 1.5}}).encode(), None)
    assert ok.ok
    assert render_switch(ok, "org/b") == "switched to org/b (prod/b), fence 9 [total 1.50s]\n"
    failed = interpret_activation(503, json.dumps({"error": {
        "type": "gpu_oom", "message": "org/b ran out of GPU memory waking"}}).encode(), "2")
    assert not failed.ok
    assert render_switch(failed, "org/b") == (
        "could not switch to org/b: gpu_oom: org/b ran out of GPU memory waking "
        "(retry after 2s)\n")
    garbled = interpret_activation(502, b"<html>bad gateway</html>", None)
    assert garbled.error == "http_502"


def test_find_claimant_names_the_node_or_says_what_exists() -> None:
    def claim(name: str, model: str, node: str) -> dict[str, Any]:
        return {"metadata": {"namespace": "prod", "name": name, "uid": name},
                "spec": {"devices": {"config": [{"requests": ["gpu"], "opaque": {
                    "driver": "gpu.rota.dev", "parameters": {
                        "apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                        "model": model, "awakeMemory": "20Gi"}}}]}},
                "status": {"allocation": {"devices": {"results": [{
                    "request": "gpu", "driver": "gpu.rota.dev", "pool": node,
                    "device": "gpu-0"}]}}}}
    claims = [claim("a", "org/a", "n1"), claim("b", "org/b", "n2"), claim("b2", "org/b", "n3")]
    assert find_claimant(claims, "org/a") == ("n1", "prod/a")
    assert find_claimant(claims, "org/b", "prod/b2") == ("n3", "prod/b2")
    with pytest.raises(LookupError, match="several nodes"):
        find_claimant(claims, "org/b")
    with pytest.raises(LookupError, match="models: org/a, org/b"):
        find_claimant(claims, "org/z")


@pytest.fixture
def lease_namespace(kube_api: client.ApiClient) -> Iterator[str]:
    name = f"rota-status-{uuid.uuid4().hex[:8]}"
    core = client.CoreV1Api(kube_api)
    core.create_namespace({"metadata": {"name": name}})
    try:
        yield name
    finally:
        core.delete_namespace(name)


@pytest.mark.cluster
def test_status_reads_the_leases_on_the_cluster(cluster: LocalCluster, kube_api: client.ApiClient,
                                                lease_namespace: str) -> None:
    leases = client.CoordinationV1Api(kube_api)
    for body in _leases(lease_namespace, dt.datetime.now(dt.UTC)):
        leases.create_namespaced_lease(lease_namespace, body)
    out = io.StringIO()
    # The controllers' URLs lead nowhere: the Leases alone still answer.
    assert main(["status", "-n", lease_namespace, "--kubeconfig", str(cluster.kubeconfig),
                 "--request-timeout", "2"], out) == 0
    text = out.getvalue()
    assert "prod/chat" in text
    assert "last error: memory_not_returned" in text
    assert "5m/15s" in text  # node-2's renewal, as its clock stamped it
    out = io.StringIO()
    assert main(["status", "-n", lease_namespace, "--kubeconfig", str(cluster.kubeconfig),
                 "--no-live", "-o", "json", "--node", "gpu-node-1"], out) == 0
    rows = json.loads(out.getvalue())
    assert [(r["gpu"], r["holder"], r["fence"]) for r in rows] == [
        ("gpu-0", "prod/chat", 7), ("gpu-1", "", 3)]
    assert "alive" not in rows[0]["controller"]
    assert rows[0]["controller"]["duration_s"] == 15
    assert rows[0]["controller"]["renew_age_s"] < 60


@pytest.mark.cluster
@pytest.mark.slow
def test_switch_and_status_against_a_real_controller(
        cluster: LocalCluster, engine_node: GpuNode, two_engines: list[Engine]) -> None:
    token = engine_node.dirs.root / "activation-token"
    token.write_text("kubectl-rota-test-token\n")
    engine_node.start_controller(extra=[f"--token-file={token}"])
    # The harness runs the controller as a process, not a pod: --direct, at its URL.
    common = ["-n", "rota-system", "--kubeconfig", str(cluster.kubeconfig),
              "--token-file", str(token), "--direct"]
    by_model = {e.spec.model: e for e in two_engines}

    def switch(model: str) -> str:
        out = io.StringIO()
        assert main([*common, "switch", model], out) == 0, out.getvalue()
        return out.getvalue()

    def holder() -> str:
        out = io.StringIO()
        assert main([*common, "status", "--node", engine_node.name, "-o", "json"], out) == 0
        [row] = json.loads(out.getvalue())
        return str(row["holder"])

    # The controller answers once it leads and has reconciled (409 not_leader before).
    eventually(lambda: switch(MODEL_B.model), timeout=90, interval=0.5,
               what="the controller switching to B")
    assert holder().endswith(f"/{by_model[MODEL_B.model].spec.name}")
    said = switch(MODEL_A.model)
    assert said.startswith(f"switched to {MODEL_A.model}"), said
    assert holder().endswith(f"/{by_model[MODEL_A.model].spec.name}")

    out = io.StringIO()
    assert main([*common, "status", "--node", engine_node.name], out) == 0
    text = out.getvalue()
    assert f"last switch: {two_engines[0].namespace}/" in text
    assert " ok in " in text
    assert "wake_call" in text

    wrong = Path(engine_node.dirs.root / "wrong-token")
    wrong.write_text("not-the-token\n")
    out = io.StringIO()
    assert main(["-n", "rota-system", "--kubeconfig", str(cluster.kubeconfig),
                 "--token-file", str(wrong), "--direct", "switch", MODEL_B.model], out) == 2
    assert "unauthorized" in out.getvalue()


# -- reaching the controllers (review-2 minor 7) -----------------------------------------


@dataclass
class ControllerPod:
    """A controller pod as the API server knows it (its IP is where the simulator
    listens), its node, and the namespace of both and of the Leases."""

    namespace: str
    name: str
    node: str
    address: str


@pytest.fixture
def controller_pod(kube_api: client.ApiClient, lease_namespace: str) -> Iterator[ControllerPod]:
    address = proxyable_address()
    if address is None:
        pytest.skip("this machine has no IPv4 address but loopback and link-local ones, "
                    "and the API server proxies to no other kind")
    core = client.CoreV1Api(kube_api)
    suffix = uuid.uuid4().hex[:6]
    pod = ControllerPod(lease_namespace, f"rota-controller-{suffix}", f"gpu-proxy-{suffix}",
                        address)
    create_node(kube_api, pod.node)
    try:
        core.create_namespaced_service_account(pod.namespace, {"metadata": {"name": "default"}})
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    core.create_namespaced_pod(pod.namespace, {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": pod.name},
        "spec": {"nodeName": pod.node, "automountServiceAccountToken": False,
                 "containers": [{"name": "controller", "image": "rota/none:0"}]}})
    core.patch_namespaced_pod_status(pod.name, pod.namespace, {"status": {
        "phase": "Running", "podIP": address, "podIPs": [{"ip": address}]}})
    try:
        yield pod
    finally:
        core.delete_node(pod.node)


def _allocated_claim(kube_api: client.ApiClient, namespace: str, name: str, model: str,
                     node: str) -> None:
    """A claim serving ``model``, allocated on ``node`` (as the scheduler writes it)."""
    objects = client.CustomObjectsApi(kube_api)
    objects.create_namespaced_custom_object("resource.k8s.io", "v1", namespace,
                                            "resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": {"devices": {
            "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.rota.dev"}}],
            "config": [{"requests": ["gpu"], "opaque": {"driver": "gpu.rota.dev", "parameters": {
                "apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                "model": model, "awakeMemory": "20Gi"}}}]}}})
    objects.patch_namespaced_custom_object_status(
        "resource.k8s.io", "v1", namespace, "resourceclaims", name, {"status": {"allocation": {
            "devices": {"results": [{"request": "gpu", "driver": "gpu.rota.dev", "pool": node,
                                     "device": "gpu-0"}]}}}})


def _publish(kube_api: client.ApiClient, pod: ControllerPod, url: str) -> None:
    """The node's GPU Lease and controller Lease, held by ``pod``, advertising ``url``."""
    leases = client.CoordinationV1Api(kube_api)
    now = dt.datetime.now(dt.UTC)
    leases.create_namespaced_lease(pod.namespace, _gpu(
        pod.namespace, pod.node, "gpu-0", holder=f"{pod.namespace}/chat", fence=4,
        state=naming.STATE_AWAKE, holder_model="org/chat"))
    body = _controller(pod.namespace, pod.node, url, renewed=now)
    body["spec"]["holderIdentity"] = pod.name
    leases.create_namespaced_lease(pod.namespace, body)


STATE = {"leases": {"gpu-0": {"holder": "x/chat", "queue": 1, "last_switch": {
    "ok": True, "from": "x/embed", "to": "x/chat", "fence": 4,
    "timings": {"total": 1.75, "wake_call": 1.25}}}}}


@pytest.mark.cluster
def test_status_and_switch_reach_the_controller_through_the_api_server(
        cluster: LocalCluster, kube_api: client.ApiClient, controller_pod: ControllerPod,
        tmp_path: Path) -> None:
    token = "kubectl-rota-proxy-token-5f1e"
    (tmp_path / "token").write_text(f"{token}\n")
    model = f"org/chat-{uuid.uuid4().hex[:6]}"
    sim = ActivationApiSimulator(controller_pod.address, token, state=STATE, serves={
        model: ActivateAnswer(model=model, claim=f"{controller_pod.namespace}/chat",
                              switched=True, fence=5, timings={"total": 2.0})})
    _allocated_claim(kube_api, controller_pod.namespace, "chat", model, controller_pod.node)
    common = ["-n", controller_pod.namespace, "--kubeconfig", str(cluster.kubeconfig),
              "--token-file", str(tmp_path / "token")]
    with serving(sim) as url:
        # Where the Lease says the controller is does not route from here: nothing listens
        # on that address; only the pod's IP, which the API server knows, leads to it.
        port = url.rsplit(":", 1)[1]
        _publish(kube_api, controller_pod, f"http://127.0.0.1:{port}")
        out = io.StringIO()
        assert main([*common, "status", "--request-timeout", "5"], out) == 0
        text = out.getvalue()
        assert "last switch: x/embed -> x/chat ok in 1.75s [wake_call 1.25s]" in text, text
        assert "not read" not in text, text

        out = io.StringIO()
        assert main([*common, "switch", model, "--timeout", "10"], out) == 0, out.getvalue()
        assert out.getvalue() == (f"switched to {model} ({controller_pod.namespace}/chat), "
                                  "fence 5 [total 2.00s]\n")

        out = io.StringIO()
        assert main([*common, "--direct", "status"], out) == 0
        assert f"live data of node {controller_pod.node} not read: http://127.0.0.1:{port} " \
               "cannot be reached" in out.getvalue(), out.getvalue()
    calls = [(s.method, s.path) for s in sim.seen]
    assert calls == [("GET", "/v1/state"), ("POST", "/v1/activate")]
    for seen in sim.seen:
        # The token travels in its own header; the API server keeps the kubeconfig's
        # credentials for itself.
        assert seen.headers.get(TOKEN_HEADER) == token
        assert "Authorization" not in seen.headers


@pytest.mark.cluster
def test_a_redirect_is_never_followed(cluster: LocalCluster, kube_api: client.ApiClient,
                                      controller_pod: ControllerPod, tmp_path: Path) -> None:
    token = "kubectl-rota-redirect-token-93ab"
    (tmp_path / "token").write_text(f"{token}\n")
    model = f"org/chat-{uuid.uuid4().hex[:6]}"
    _allocated_claim(kube_api, controller_pod.namespace, "chat", model, controller_pod.node)
    elsewhere = ActivationApiSimulator(controller_pod.address, None)
    common = ["-n", controller_pod.namespace, "--kubeconfig", str(cluster.kubeconfig),
              "--token-file", str(tmp_path / "token")]
    with serving(elsewhere) as thief, \
            serving(ActivationApiSimulator(controller_pod.address, token,
                                           redirect_to=thief)) as url:
        # Reachable directly too: the redirect is the only thing in the way.
        _publish(kube_api, controller_pod, url)
        said: list[tuple[list[str], int, str]] = []
        for how in (["status"], ["switch", model, "--timeout", "10"]):
            for direct in ([], ["--direct"]):
                out = io.StringIO()
                said.append(([*direct, *how], main([*common, *direct, *how], out),
                             out.getvalue()))
    # Nothing, least of all the token, reached where the redirect pointed.
    assert [(s.method, s.path, s.headers.get("Authorization")) for s in elsewhere.seen] == []
    for args, code, text in said:
        assert code == (0 if args[-1] == "status" else 1), (args, text)
        assert "a redirect, which is never followed" in text, (args, text)
