"""``rota-cluster``: start, stop and inspect rota's local Kubernetes from a shell."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from e2e.cluster import binaries
from e2e.cluster.local import STATE_FILE, ClusterOptions, LocalCluster, stop_from_state
from e2e.cluster.nodes import create_node
from rota.kit.logs import configure

DEFAULT_DIR = Path(".rota/cluster")


def _parse_gates(text: str) -> dict[str, bool]:
    gates: dict[str, bool] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = item.partition("=")
        if value.lower() not in ("true", "false"):
            raise argparse.ArgumentTypeError(f"feature gate {item!r}: expected NAME=true|false")
        gates[name] = value.lower() == "true"
    return gates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="rota-cluster",
        description="Run a local Kubernetes control plane (etcd, kube-apiserver, "
                    "kube-scheduler, kube-controller-manager) built from source, on loopback, "
                    "with real nodes (kubelet, containerd, runc, bridge CNI in namespaces of "
                    "their own; root) or static Node objects.",
    )
    parser.add_argument("--log-level", default="warning")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build the binaries if needed, start the cluster, and return")
    up.add_argument("--dir", type=Path, default=DEFAULT_DIR,
                    help="working directory: certificates, etcd data, logs (default %(default)s)")
    up.add_argument("--feature-gates", type=_parse_gates, default={},
                    help="e.g. DRAConsumableCapacity=false; applied to every component")
    up.add_argument("--node", action="append", default=[],
                    help="create a static, schedulable Node object of this name (no kubelet; "
                         "repeatable)")
    up.add_argument("--real-node", action="append", default=[], metavar="NAME",
                    help="start a real node of this name with a fake GPU: kubelet, "
                         "containerd, runc, CNI, rota's images imported (repeatable; root)")
    up.add_argument("--rota", action="store_true",
                    help="deploy rota from manifests/ on the real nodes and wait until its "
                         "pods are Ready")
    down = sub.add_parser("down", help="stop the processes a previous 'up' started, by pid")
    down.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    status = sub.add_parser("status", help="print the recorded state of a running cluster")
    status.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    sub.add_parser("build", help="build (or find cached) binaries and print their directory")
    args = parser.parse_args(argv)
    configure(args.log_level)

    if args.command == "build":
        print(binaries.locate())
        return 0
    if args.command == "down":
        if not (args.dir / STATE_FILE).exists():
            print(f"no cluster recorded in {args.dir}", file=sys.stderr)
            return 1
        print("stopped: " + ", ".join(stop_from_state(args.dir)))
        return 0
    if args.command == "status":
        path = args.dir / STATE_FILE
        if not path.exists():
            print(f"no cluster recorded in {args.dir}", file=sys.stderr)
            return 1
        print(path.read_text())
        return 0

    if (args.dir / STATE_FILE).exists():
        print(f"a cluster is already recorded in {args.dir}; run 'rota-cluster down' first",
              file=sys.stderr)
        return 1
    started = time.monotonic()
    cluster = LocalCluster(args.dir.resolve(), ClusterOptions(feature_gates=args.feature_gates))
    cluster.start(die_with_parent=False)
    api = cluster.api_client()
    for name in args.node:
        create_node(api, name)
    summary: dict[str, object] = {"server": cluster.server,
                                  "kubeconfig": str(cluster.kubeconfig),
                                  "logs": str(cluster.log_dir),
                                  "control_plane_s": round(time.monotonic() - started, 1)}
    if args.real_node:
        summary.update(_real_nodes(cluster, api, args.real_node, deploy_rota=args.rota))
    summary["seconds"] = round(time.monotonic() - started, 1)
    api.close()
    print(json.dumps(summary, indent=2))
    print(f"\n  export KUBECONFIG={cluster.kubeconfig}\n  kubectl get nodes,resourceslices\n"
          f"  rota-cluster down --dir {args.dir}")
    return 0


def _real_nodes(cluster: LocalCluster, api: Any, names: list[str], *,
                deploy_rota: bool) -> dict[str, object]:
    from e2e.cluster.realnode import RealNode
    from e2e.harness.deploy import deploy
    from e2e.harness.rota_node import RotaOnNodes, build_rota_images

    started = time.monotonic()
    images = build_rota_images()
    out: dict[str, object] = {"images_s": round(time.monotonic() - started, 1)}
    nodes = []
    for name in names:
        node = RealNode(cluster, name, images, bin_dir=binaries.locate())
        node.start(die_with_parent=False)
        cluster.record_real_node(node.id)
        nodes.append(node)
    out["nodes"] = {n.name: {"ready_s": round(n.times.kubelet_ready, 1), "logs": str(n.logs),
                             "node_ip": n.node_ip} for n in nodes}
    if deploy_rota:
        begun = time.monotonic()
        rota = RotaOnNodes(cluster, nodes, deploy(api, nodes=names, gateway_nodes=names))
        rota.wait_ready()
        out["rota_ready_s"] = round(time.monotonic() - begun, 1)
        out["gateway"] = rota.gateway_url()
    return out


if __name__ == "__main__":
    sys.exit(main())
