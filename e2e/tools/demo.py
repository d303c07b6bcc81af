"""The embedded demo: ``make demo``.

Builds rota's images from this repository, brings up rota's local cluster (real etcd,
kube-apiserver, kube-scheduler and kube-controller-manager) and one real node (kubelet,
containerd, runc and bridge CNI in namespaces of its own, with a fake H200: the answers of
a real one, recorded), applies rota from ``manifests/`` as an admin would (driver and
lease controller DaemonSets, the gateway Deployment), and deploys two simulated engines
from ``manifests/examples/two-models.yaml``. It shows ``kubectl get pods``, sends requests
for both models through the gateway and shows who was awake and what each switch cost.
Everything it started is stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client

from e2e.cluster import LocalCluster, binaries
from e2e.cluster.realnode import RealNode
from e2e.harness.deploy import deploy
from e2e.harness.objects import read_gpu_lease
from e2e.harness.rota_node import RotaOnNodes, build_rota_images
from e2e.harness.scenario import stream_chat
from e2e.harness.waiting import eventually
from rota.api.activation import STATE_PATH, LastSwitch, StateAnswer
from rota.kit.logs import configure

NAMESPACE = "demo"
NODE = "gpu-node-1"
MODELS = ("org/model-a", "org/model-b")


def say(text: str = "") -> None:
    print(text, flush=True)


def _lease(api: client.ApiClient) -> dict[str, Any]:
    lease = read_gpu_lease(api, NODE, "gpu-0")
    return {"holder": lease.holder or "-", "fence": lease.fence,
            "model": lease.holder_model or "-"}


async def _last_switch(session: aiohttp.ClientSession, controller: str, token: str
                       ) -> LastSwitch | None:
    async with session.get(f"{controller}{STATE_PATH}",
                           headers={"Authorization": f"Bearer {token}"},
                           timeout=aiohttp.ClientTimeout(total=5)) as resp:
        state = StateAnswer.model_validate(await resp.json())
    lease = state.leases.get("gpu-0")
    return lease.last_switch if lease is not None else None


async def _conversation(api: client.ApiClient, gateway: str, controller: str, token: str,
                        rounds: int) -> None:
    async with aiohttp.ClientSession() as session:
        for i in range(rounds):
            model = MODELS[i % 2]
            before = _lease(api)
            reply = await stream_chat(session, gateway, model, max_tokens=12, ignore_eos=True,
                                      timeout_s=120)
            answer, ttft, total = reply.content, reply.ttft_s, reply.total_s
            after = _lease(api)
            switched = after["fence"] != before["fence"]
            say(f"  {i + 1:>2}. {model:<12} -> {answer[:24]!r:<28} first token {ttft * 1e3:7.1f} ms"
                f"  total {total * 1e3:7.1f} ms  awake: {after['model']}")
            if switched:
                last = await _last_switch(session, controller, token)
                t = last.timings if last is not None else {}
                say(f"      switch {before['model']} -> {after['model']}: "
                    f"handoff to first token {t.get('handoff_to_first_token', 0) * 1e3:.0f} ms"
                    f" (sleep {t.get('sleep', 0) * 1e3:.0f} ms, wake call "
                    f"{t.get('wake_call', 0) * 1e3:.0f} ms, recovery to first token "
                    f"{t.get('recovery_to_first_token', 0) * 1e3:.0f} ms)")


def _kubectl(kubeconfig: Path, *args: str) -> str:
    """``kubectl <args>`` as an admin would type it (the binary built with the cluster)."""
    binary = binaries.locate() / "kubectl"
    proc = subprocess.run([str(binary), f"--kubeconfig={kubeconfig}", *args],
                          capture_output=True, text=True, check=False, timeout=60)
    return (proc.stdout or proc.stderr).rstrip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.tools.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="requests to send")
    parser.add_argument("--keep", action="store_true",
                        help="keep everything running until Ctrl-C, to explore with kubectl")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    configure(args.log_level)
    say("rota demo: two simulated engines share one (fake) H200 in turns, on a real node")
    started = time.perf_counter()
    images = build_rota_images()
    say(f"  images ready in {time.perf_counter() - started:.1f} s "
        f"(built: {', '.join(images.built) or 'none, all cached'}; "
        f"{images.size_bytes / 2**20:.0f} MiB of layers)")
    with LocalCluster() as cluster:
        say(f"  local control plane up in {time.perf_counter() - started:.1f} s "
            f"(kubeconfig {cluster.kubeconfig})")
        api = cluster.api_client()
        node = RealNode(cluster, NODE, images, bin_dir=binaries.locate())
        try:
            node.start()
            say(f"  node {NODE} Ready in {node.times.kubelet_ready:.1f} s: kubelet "
                "1.37.2, containerd 2.4.2, runc, bridge CNI, in namespaces of its own")
            begun = time.perf_counter()
            rota = RotaOnNodes(cluster, [node], deploy(api, nodes=[NODE], gateway_nodes=[NODE],
                                                       serving_namespaces=[NAMESPACE]))
            rota.wait_ready()
            say(f"  rota applied from manifests/: its pods Ready in "
                f"{time.perf_counter() - begun:.1f} s")
            rota.deploy_engines(NAMESPACE)
            # Both engines start awake, as vLLM does; the controller puts one to sleep.
            eventually(lambda: _lease(api)["holder"] != "-", timeout=120,
                       what="the controller reconciled the GPU")
            say("\n$ kubectl get pods -A -o wide")
            say(_kubectl(cluster.kubeconfig, "get", "pods", "-A", "-o", "wide"))
            say(f"\n  the controller reconciled: {_lease(api)['model']} awake, the other asleep")
            say("  both engines running on the same GPU; sending requests through the gateway:")
            asyncio.run(_conversation(api, rota.gateway_url(), rota.controller_url(),
                                      rota.deployment.token, args.rounds))
            say(f"\n  GPU lease now: {_lease(api)}")
            memory = node.resident_memory_bytes()
            say(f"  node memory (RSS): {sum(memory.values()) / 2**20:.0f} MiB "
                f"(kubelet {memory.get('kubelet', 0) / 2**20:.0f}, containerd "
                f"{memory.get('containerd', 0) / 2**20:.0f}, shims "
                f"{memory.get('containerd-shim', 0) / 2**20:.0f} MiB)")
            if args.keep:
                say(f"\n  export KUBECONFIG={cluster.kubeconfig}   "
                    f"# kubectl: {binaries.locate() / 'kubectl'}\n"
                    "  kubectl get resourceslices,resourceclaims -A; kubectl -n demo get pods\n"
                    "  press Ctrl-C to stop")
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
        finally:
            node.stop()
            api.close()
    say("  stopped everything the demo started.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
