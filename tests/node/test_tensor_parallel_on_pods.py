"""Engines that span GPUs, through real pods: a tensor-parallel engine (TP=2) and two
one-GPU engines take turns on a two-GPU fake node, handed off through the gateway.

The module switches the node's driver to the two-GPU fixture (``h200x2``: the first two
GPUs of the eight-GPU node) for its duration, and back afterwards. In one namespace:

- ``tp``: a claim on both GPUs (``count: 2``, distinct GPUs), the engine simulator with
  ``--tensor-parallel-size 2`` (one rank per GPU, each a process of the pod, each holding
  80 GiB awake, 2 GiB asleep);
- ``one-a`` on gpu-0 and ``one-b`` on gpu-1 (CEL selectors on the GPU's index), 80 GiB
  awake each: neither fits awake beside the TP engine's shard on its GPU.

Requests through the gateway go TP=2, then both one-GPU engines, then TP=2, and back. After
each answer: every GPU's Lease names its holder as a user reads it (the TP engine on both,
with the ``gpu.rota.dev/gang`` annotation), the engines say whether they sleep, and the pods'
``gpu.rota.dev/state`` labels follow. The driver's inspection API is sampled throughout: no
sample may show two engines above their resident memory on one GPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from kubernetes import client

from controller.lease.device import DeviceReader
from controller.lease.visible_state import LABEL_STATE
from e2e.harness.deploy import DRIVER, NAMESPACE
from e2e.harness.objects import DRIVER as DRA_DRIVER
from e2e.harness.objects import create_namespace, node_slices
from e2e.harness.rota_node import RotaOnNodes, gated_engine_docs, watched_engines
from e2e.harness.scenario import AwakeMonitor, Engine, EngineSpec, ask_seven
from e2e.harness.waiting import eventually, eventually_async
from rota.api import naming
from rota.api.quantity import parse_quantity
from tests.real_node import needs_root

pytestmark = [pytest.mark.cluster, pytest.mark.node, pytest.mark.slow, needs_root]

FIXTURE = "h200x2"
GPUS = ("gpu-0", "gpu-1")
RESIDENT, AWAKE = "2Gi", "80Gi"
"""Per GPU. Two awake on one fake H200 (140.4 GiB) do not fit."""
MODELS = {"tp": "org/tp-two", "one-a": "org/tp-one-a", "one-b": "org/tp-one-b"}
HOME = {"one-a": "gpu-0", "one-b": "gpu-1"}
"""Where each one-GPU engine runs."""
TURNS = ("tp", "one-a", "one-b", "tp", "one-b", "one-a", "tp")


@dataclass
class GpuLeaseView:
    """A GPU Lease as ``kubectl get lease -o yaml`` shows it to a user."""

    holder: str
    model: str
    state: str
    gang: str


@dataclass
class Stage:
    rota: RotaOnNodes
    namespace: str
    engines: dict[str, Engine]
    monitor: AwakeMonitor
    urls: dict[str, str] = field(default_factory=dict)

    def lease(self, gpu: str) -> GpuLeaseView:
        lease = client.CoordinationV1Api(self.rota.api).read_namespaced_lease(
            naming.gpu_lease_name(self.rota.node().name, gpu), NAMESPACE, _request_timeout=10)
        notes = lease.metadata.annotations or {}
        return GpuLeaseView(lease.spec.holder_identity or "", notes.get(naming.HOLDER_MODEL, ""),
                            notes.get(naming.STATE, ""), notes.get(naming.GANG, ""))

    def leases(self) -> dict[str, GpuLeaseView]:
        return {gpu: self.lease(gpu) for gpu in GPUS}

    def holder(self, name: str) -> str:
        return f"{self.namespace}/{name}"

    def labels(self) -> dict[str, str]:
        core = client.CoreV1Api(self.rota.api)
        return {name: (core.read_namespaced_pod(name, self.namespace, _request_timeout=10)
                       .metadata.labels or {}).get(LABEL_STATE, "") for name in MODELS}

    async def sleeping(self, session: aiohttp.ClientSession) -> dict[str, bool]:
        found = {}
        for name, url in self.urls.items():
            async with session.get(f"{url}/sim/state",
                                   timeout=aiohttp.ClientTimeout(total=10)) as resp:
                resp.raise_for_status()
                found[name] = bool((await resp.json())["sleeping"])
        return found

    async def sim_state(self, session: aiohttp.ClientSession, name: str) -> dict[str, Any]:
        async with session.get(f"{self.urls[name]}/sim/state",
                               timeout=aiohttp.ClientTimeout(total=10)) as resp:
            resp.raise_for_status()
            return dict(await resp.json())


def _published(api: client.ApiClient, node: str) -> list[str]:
    return [d["attributes"]["uuid"]["string"] for s in node_slices(api, node)
            for d in s["spec"]["devices"]]


def _with_fixture(daemonset: dict[str, Any], fixture: str) -> dict[str, Any]:
    """The driver DaemonSet with the fake NVML told ``fixture``."""
    out = copy.deepcopy(daemonset)
    driver = next(c for c in out["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "driver")
    for entry in driver["env"]:
        if entry["name"] == "ROTA_FAKE_NVML_FIXTURE":
            entry["value"] = fixture
    return out


@contextlib.contextmanager
def two_gpu_node(rota: RotaOnNodes) -> Iterator[None]:
    """The node's driver on the two-GPU fixture (a rolling update of its DaemonSet), and
    back to what it was afterwards."""
    deployment = rota.deployment
    before = deployment.daemonset(DRIVER)
    node = rota.node().name
    deployment.applier.apply([_with_fixture(before, FIXTURE)])
    try:
        eventually(lambda: len(_published(rota.api, node)) == 2, timeout=180,
                   max_interval=2.0, what="the driver publishing two GPUs")
        rota.wait_ready()
        yield
    finally:
        deployment.applier.apply([before])
        eventually(lambda: len(_published(rota.api, node)) == 1, timeout=180,
                   max_interval=2.0, what="the driver publishing one GPU again")
        rota.wait_ready()
        # gpu-1's Lease stays, as a removed GPU's does on any node (printed, not asserted).
        with contextlib.suppress(client.ApiException):
            left = client.CoordinationV1Api(rota.api).read_namespaced_lease(
                naming.gpu_lease_name(node, GPUS[1]), NAMESPACE, _request_timeout=10)
            print(f"\n{GPUS[1]}'s Lease after the node went back to one GPU: "
                  f"holder {left.spec.holder_identity!r}, {left.metadata.annotations}")


def _docs(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    claim, pod = gated_engine_docs(name, model=MODELS[name], resident=RESIDENT, awake=AWAKE)
    request = claim["spec"]["devices"]["requests"][0]["exactly"]
    container = pod["spec"]["containers"][0]
    if name == "tp":
        request |= {"allocationMode": "ExactCount", "count": 2}
        claim["spec"]["devices"]["constraints"] = [
            {"requests": ["gpu"], "distinctAttribute": f"{DRA_DRIVER}/uuid"}]
        # The memory knobs of a TP engine are its totals; the claim's awake budget is per
        # GPU (ROTA_AWAKE_MEMORY_BYTES), its resident one summed over the GPUs.
        container["args"] += ["--tensor-parallel-size", "2", "--awake-memory-bytes", "160Gi"]
    else:
        index = GPUS.index(HOME[name])
        request["selectors"] = [{"cel": {
            "expression": f'device.attributes["{DRA_DRIVER}"].index == {index}'}}]
    return claim, pod


@pytest.fixture(scope="module")
def stage(kube_api: client.ApiClient, rota_node: RotaOnNodes) -> Iterator[Stage]:
    namespace = f"tp-{uuid.uuid4().hex[:6]}"
    with two_gpu_node(rota_node):
        create_namespace(kube_api, namespace)
        docs = {name: _docs(name) for name in MODELS}
        specs = {name: EngineSpec(name, model, resident=RESIDENT, awake=AWAKE)
                 for name, model in MODELS.items()}
        try:
            with watched_engines(rota_node, namespace, docs, specs) as watched:
                yield Stage(rota_node, namespace, watched.engines, watched.monitor,
                            watched.urls)
        finally:
            core = client.CoreV1Api(kube_api)
            with contextlib.suppress(client.ApiException):
                core.delete_namespace(namespace, _request_timeout=10)

            def gone() -> bool:
                try:
                    core.read_namespace(namespace, _request_timeout=10)
                except client.ApiException as exc:
                    return bool(exc.status == 404)
                return False

            # The engines' claims leave the GPUs before the driver goes back to one.
            eventually(gone, timeout=240, max_interval=2.0, what=f"namespace {namespace} gone")


async def _tp_on_the_gpus(stage: Stage) -> dict[str, tuple[int, int, str]]:
    """What the driver's inspection API shows of the TP engine on each GPU: (pid, bytes,
    pod uid) of its one process there."""
    reader = DeviceReader(stage.rota.inspection_socket(), timeout_s=10)
    try:
        gpus = await reader.read()
    finally:
        await reader.close()
    found = {}
    for gpu, snapshot in gpus.items():
        (process,) = [p for p in snapshot.processes
                      if p.claim_uid == stage.engines["tp"].claim_uid]
        found[gpu] = (process.pid, process.used_bytes, process.pod_uid)
    return found


async def _answer(session: aiohttp.ClientSession, gateway: str, model: str) -> str:
    return await eventually_async(functools.partial(ask_seven, session, gateway, model),
                                  timeout=180, max_interval=3.0,
                                  what=f"an answer from {model} through {gateway}")


def _check_leases(stage: Stage, awake: set[str]) -> None:
    """Each GPU's Lease names the engine awake on it, as a user reads it: the TP engine on
    both with its gang, a one-GPU engine on its own GPU with none; a GPU nobody holds names
    nobody (never the sleeping TP engine)."""
    leases = stage.leases()
    for gpu, lease in leases.items():
        if "tp" in awake:
            wanted = GpuLeaseView(stage.holder("tp"), MODELS["tp"], naming.STATE_AWAKE,
                                  ",".join(GPUS))
            assert lease == wanted, (gpu, leases)
            continue
        mine = [name for name, home in HOME.items() if home == gpu and name in awake]
        if mine:
            (name,) = mine
            assert lease == GpuLeaseView(stage.holder(name), MODELS[name],
                                         naming.STATE_AWAKE, ""), (gpu, leases)
        else:
            assert lease.holder != stage.holder("tp"), (gpu, leases)
            assert lease.state != naming.STATE_AWAKE or lease.holder, (gpu, leases)


async def test_a_tensor_parallel_engine_and_two_one_gpu_engines_take_turns(
        stage: Stage) -> None:
    """TP=2 → both one-GPU engines → TP=2 → ... through the gateway: each answer comes from
    its model; the TP engine is awake only as the holder of both GPUs' Leases (each carrying
    ``gpu.rota.dev/gang: gpu-0,gpu-1``), the one-GPU engines share the node awake while it
    sleeps; the pods' state labels follow; no sample showed two engines awake on a GPU."""
    gateways = stage.rota.gateway_urls()
    async with aiohttp.ClientSession() as session:
        tp = await stage.sim_state(session, "tp")
        assert tp["tensor_parallel_size"] == 2
        ranks = tp["memory"]["ranks"]
        assert len({r["pid"] for r in ranks}) == 2
        assert len({r["gpu_uuid"] for r in ranks}) == 2
        tp_pod = await asyncio.to_thread(
            lambda: client.CoreV1Api(stage.rota.api).read_namespaced_pod(
                "tp", stage.namespace, _request_timeout=10).metadata.uid)
        awake: set[str] = set()
        for i, name in enumerate(TURNS):
            answer = await _answer(session, gateways[i % len(gateways)], MODELS[name])
            assert answer.strip() == "7"
            if name == "tp":
                awake = {"tp"}
            else:
                awake = (awake - {"tp"}) | {name}
            await asyncio.to_thread(_check_leases, stage, awake)
            print(f"\nturn {i} {name}: {await asyncio.to_thread(stage.leases)}")
            if name == "tp":
                # One process per GPU, each holding its shard awake, each the TP pod's.
                shown = await _tp_on_the_gpus(stage)
                assert sorted(shown) == list(GPUS), shown
                assert len({pid for pid, _, _ in shown.values()}) == 2, shown
                assert {used for _, used, _ in shown.values()} == {parse_quantity(AWAKE)}
                assert {pod for _, _, pod in shown.values()} == {tp_pod}, shown
            sleeping = await stage.sleeping(session)
            assert sleeping == {n: n not in awake for n in MODELS}, (name, sleeping)
            if awake == {"one-a", "one-b"}:
                wanted = {"tp": "asleep", "one-a": "awake", "one-b": "awake"}
                await asyncio.to_thread(
                    eventually, lambda w=wanted: stage.labels() == w,
                    timeout=30, what=f"the pods' {LABEL_STATE} labels: {wanted}")
            await asyncio.to_thread(stage.monitor.wait_next)
    wanted = {"tp": "awake", "one-a": "asleep", "one-b": "asleep"}
    eventually(lambda: stage.labels() == wanted, timeout=30,
               what=f"the pods' {LABEL_STATE} labels: {wanted}")
    print(f"\n{len(TURNS)} turns, {stage.monitor.samples} samples of both GPUs, leases at "
          f"the end: {stage.leases()}")
    assert stage.monitor.samples > 0
    assert not stage.monitor.violations, stage.monitor.violations[:10]
