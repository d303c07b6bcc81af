"""Benchmark of the DRA driver on the local cluster, over its real socket.

    python -m e2e.bench.driver [--rounds 200] [--batch-rounds 30]

Prints one line per measurement and a JSON object last:
- prepare latency of one claim and of 32 claims in one call (p50, p99), each claim read
  from the real apiserver, recorded in the ledger and given a CDI spec;
- the time to publish the slices of a node with 8 GPUs (first publish, and a sync that
  finds them unchanged);
- API writes made by a driver restarted over unchanged slices.
Targets: one-claim p50 <= 10 ms, p99 <= 40 ms; 32 claims p50 <= 100 ms; 0 writes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from typing import Any

import grpc
from kubernetes import client

from driver.devices import discover
from driver.nvml import fixture_path
from driver.nvml.fake import FakeNvml
from driver.publisher import SlicePublisher
from driver.slices import SharingMode
from e2e.bench.stats import summary_ms
from e2e.cluster import LocalCluster, create_node
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import GROUP, VERSION, claim, create_claim, create_namespace, engine_config
from rota.kit.grpc_services import unary_client
from rota.kit.kube import Kube
from rota.pb.dra.v1 import api_pb2 as dra

SERVICE = dra.DESCRIPTOR.services_by_name["DRAPlugin"]


def _allocated_claims(api: client.ApiClient, namespace: str, node: str, count: int
                      ) -> list[dra.Claim]:
    objects = client.CustomObjectsApi(api)
    refs = []
    for i in range(count):
        body = claim(f"c{i}", memory="1Gi", config=engine_config(model=f"m{i}", awake="4Gi"))
        created = create_claim(api, namespace, body)
        created["status"] = {"allocation": {"devices": {"results": [{
            "request": "gpu", "driver": "gpu.rota.dev", "pool": node, "device": "gpu-0",
            "shareID": str(uuid.uuid4()),
            "consumedCapacity": {"memory": "1Gi", "engines": "1"}}]}}}
        objects.replace_namespaced_custom_object_status(GROUP, VERSION, namespace,
                                                        "resourceclaims", f"c{i}", created)
        refs.append(dra.Claim(namespace=namespace, uid=created["metadata"]["uid"],
                              name=f"c{i}"))
    return refs


async def _prepare_latency(node: GpuNode, refs: list[dra.Claim], batch: int, rounds: int
                           ) -> list[float]:
    times: list[float] = []
    async with grpc.aio.insecure_channel(f"unix://{node.dirs.dra_socket}") as channel:
        prepare = unary_client(channel, SERVICE, "NodePrepareResources")
        unprepare = unary_client(channel, SERVICE, "NodeUnprepareResources")
        for r in range(rounds):
            chosen = refs[:batch] if batch > 1 else [refs[r % len(refs)]]
            start = time.perf_counter()
            answer = await prepare(dra.NodePrepareResourcesRequest(claims=chosen), timeout=30)
            times.append(time.perf_counter() - start)
            errors = [e.error for e in answer.claims.values() if e.error]
            if errors:
                raise RuntimeError(f"prepare failed: {errors[0]}")
            await unprepare(dra.NodeUnprepareResourcesRequest(claims=chosen), timeout=30)
    return times


async def _publish_times(cluster: LocalCluster, api: client.ApiClient) -> dict[str, float]:
    backend = FakeNvml.from_path(fixture_path("h200x8"))
    backend.init()
    gpus = discover(backend)
    node = f"bench8-{uuid.uuid4().hex[:6]}"
    create_node(api, node)
    kube = Kube(api)
    publisher = SlicePublisher(kube=kube, node_name=node, gpus=gpus, mode=SharingMode.SHARED,
                               engines=8)
    start = time.perf_counter()
    first_writes = await publisher.sync_once()
    first = time.perf_counter() - start
    start = time.perf_counter()
    again_writes = await publisher.sync_once()
    again = time.perf_counter() - start
    return {"gpus": len(gpus), "first_publish_ms": first * 1e3, "first_writes": first_writes,
            "unchanged_sync_ms": again * 1e3, "unchanged_writes": again_writes}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.driver",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=200, help="one-claim prepares")
    parser.add_argument("--batch-rounds", type=int, default=30, help="32-claim prepares")
    args = parser.parse_args(argv)
    result: dict[str, Any] = {}
    with LocalCluster() as cluster:
        api = cluster.api_client()
        node = GpuNode(cluster=cluster, api=api, name=f"bench-{uuid.uuid4().hex[:6]}")
        try:
            namespace = f"bench-{uuid.uuid4().hex[:6]}"
            create_namespace(api, namespace)
            start = time.perf_counter()
            node.start_driver()
            result["driver_start_to_ready_s"] = round(time.perf_counter() - start, 3)
            refs = _allocated_claims(api, namespace, node.name, 32)
            one = asyncio.run(_prepare_latency(node, refs, 1, args.rounds))
            many = asyncio.run(_prepare_latency(node, refs, 32, args.batch_rounds))
            for label, values in (("prepare_1", one), ("prepare_32", many)):
                result[label] = summary_ms(values)
                print(f"{label}: {result[label]}")
            result["publish_8_gpus"] = {k: round(v, 2) for k, v in
                                        asyncio.run(_publish_times(cluster, api)).items()}
            print(f"publish_8_gpus: {result['publish_8_gpus']}")
            node.stop_driver()
            node.start_driver()
            result["writes_on_unchanged_restart"] = node.driver_metric(
                "rota_driver_slice_writes_total")
            print(f"writes_on_unchanged_restart: {result['writes_on_unchanged_restart']}")
        finally:
            node.close()
            api.close()
    result["targets_met"] = (result["prepare_1"]["p50_ms"] <= 10
                             and result["prepare_1"]["p99_ms"] <= 40
                             and result["prepare_32"]["p50_ms"] <= 100
                             and result["writes_on_unchanged_restart"] == 0)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
