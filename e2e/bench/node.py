"""Benchmark of a real node: ``python -m e2e.bench.node``.

Measures what starting a real node and rota on it costs on this machine: the images (built
or cached), the control plane, the node until Ready (and its parts: namespaces, containerd,
image import), rota's pods until Ready, the start of pods with a DRA claim (scheduled,
allocated, prepared by rota's driver, CDI applied, running; with the pause image, so no
program start is measured), and the node's memory. Prints a JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from kubernetes import client

from e2e.bench.stats import summary_ms
from e2e.cluster import LocalCluster, binaries
from e2e.cluster.realnode import RealNode
from e2e.harness.deploy import deploy
from e2e.harness.objects import claim, create_claim, create_namespace
from e2e.harness.rota_node import RotaOnNodes, build_rota_images
from e2e.harness.waiting import eventually
from e2e.images import PAUSE_IMAGE
from rota.kit.logs import configure


def _claim_pod(name: str, node: str) -> dict[str, object]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {"kubernetes.io/hostname": node},
                     "containers": [{"name": "c", "image": PAUSE_IMAGE,
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": name}]}}


def _pod_starts(api: client.ApiClient, node: str, count: int) -> list[float]:
    core = client.CoreV1Api(api)
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    create_namespace(api, namespace)
    seconds = []
    for i in range(count):
        name = f"p{i}"
        create_claim(api, namespace, claim(name, memory="1Gi"))
        started = time.perf_counter()
        core.create_namespaced_pod(namespace, _claim_pod(name, node))
        eventually(lambda n=name: core.read_namespaced_pod(n, namespace).status.phase  # type: ignore[misc]
                   == "Running", timeout=120, interval=0.02, max_interval=0.1,
                   what=f"pod {name} running")
        seconds.append(time.perf_counter() - started)
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    core.delete_namespace(namespace)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.node", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pods", type=int, default=5, help="pods with a claim to start")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    configure(args.log_level)
    result: dict[str, object] = {}
    started = time.perf_counter()
    images = build_rota_images()
    result["images_s"] = round(time.perf_counter() - started, 2)
    result["images_built"] = images.built
    result["image_layers_mib"] = round(images.size_bytes / 2**20, 1)
    control_plane = time.perf_counter()
    with LocalCluster() as cluster:
        result["control_plane_s"] = round(time.perf_counter() - control_plane, 2)
        api = cluster.api_client()
        node = RealNode(cluster, "bench-node", images, bin_dir=binaries.locate())
        try:
            begun = time.perf_counter()
            node.start()
            result["node"] = {"namespaces_s": round(node.times.namespaces, 2),
                              "containerd_s": round(node.times.containerd, 2),
                              "images_imported_s": round(node.times.images, 2),
                              "ready_s": round(node.times.kubelet_ready, 2)}
            rota = RotaOnNodes(cluster, [node], deploy(api, nodes=[node.name],
                                                       gateway_nodes=[node.name]))
            rota.wait_ready()
            result["rota_ready_after_node_s"] = round(time.perf_counter() - begun
                                                      - node.times.kubelet_ready, 2)
            starts = _pod_starts(api, node.name, args.pods)
            result["pod_with_claim_start_ms"] = summary_ms(starts)
            memory = node.resident_memory_bytes()
            result["node_rss_mib"] = {k: round(v / 2**20, 1) for k, v in sorted(memory.items())}
            result["node_rss_total_mib"] = round(sum(memory.values()) / 2**20, 1)
        finally:
            node.stop()
            api.close()
    for key, value in result.items():
        print(f"{key}: {value}", file=sys.stderr)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
