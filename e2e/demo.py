"""The embedded demo: ``make demo``.

Brings up rota's local cluster (real etcd, kube-apiserver, kube-scheduler and
kube-controller-manager), one GPU node with the rota driver on a fake H200 (the answers of
a real one, recorded), the node agent in the kubelet's place, the lease controller, the
gateway, and two simulated engines from ``manifests/examples/two-models.yaml``. Then it
sends requests for both models through the gateway and shows who was awake and what each
switch cost. Everything it started is stopped when it ends.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
from kubernetes import client, config

from controller import naming
from driver.logs import configure
from e2e.cluster import LocalCluster
from e2e.harness import GpuNode
from e2e.objects import MANIFESTS, apply_manifest
from e2e.scenario import stream_chat
from e2e.waiting import eventually

NAMESPACE = "demo"
NODE = "gpu-node-1"
MODELS = ("org/model-a", "org/model-b")
TOKEN = "rota-demo-token"


def say(text: str = "") -> None:
    print(text, flush=True)


def _lease(api: client.ApiClient) -> dict[str, Any]:
    lease = client.CoordinationV1Api(api).read_namespaced_lease(
        naming.gpu_lease_name(NODE, "gpu-0"), "rota-system")
    annotations = lease.metadata.annotations or {}
    return {"holder": lease.spec.holder_identity or "-", "fence": lease.spec.lease_transitions,
            "model": annotations.get(naming.HOLDER_MODEL, "-")}


async def _last_switch(session: aiohttp.ClientSession, controller: str, token: str
                       ) -> dict[str, Any]:
    async with session.get(f"{controller}/v1/state",
                           headers={"Authorization": f"Bearer {token}"},
                           timeout=aiohttp.ClientTimeout(total=5)) as resp:
        state = await resp.json()
    lease = state["leases"].get("gpu-0", {})
    return dict(lease.get("last_switch") or {})


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
                t = last.get("timings", {})
                say(f"      switch {before['model']} -> {after['model']}: "
                    f"handoff to first token {t.get('handoff_to_first_token', 0) * 1e3:.0f} ms"
                    f" (sleep {t.get('sleep', 0) * 1e3:.0f} ms, wake call "
                    f"{t.get('wake_call', 0) * 1e3:.0f} ms, recovery to first token "
                    f"{t.get('recovery_to_first_token', 0) * 1e3:.0f} ms)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="requests to send")
    parser.add_argument("--keep", action="store_true",
                        help="keep everything running until Ctrl-C, to explore with kubectl")
    parser.add_argument("--log-level", default="warning")
    args = parser.parse_args(argv)
    configure(args.log_level)
    say("rota demo: two simulated engines share one (fake) H200 in turns")
    started = time.perf_counter()
    with LocalCluster() as cluster:
        say(f"  local cluster up in {time.perf_counter() - started:.1f} s "
            f"(kubeconfig {cluster.kubeconfig})")
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        node = GpuNode(cluster=cluster, api=api, name=NODE)
        try:
            apply_manifest(api, MANIFESTS / "deviceclass.yaml")
            client.CoreV1Api(api).create_namespace({"metadata": {"name": NAMESPACE}})
            node.start_driver()
            node.start_agent()
            token: Path = node.dirs.root / "activation-token"
            token.write_text(TOKEN + "\n")
            node.start_controller(extra=[f"--token-file={token}"])
            gateway = node.start_gateway(token_file=token,
                                         extra=[f"--serving-namespaces={NAMESPACE}"])
            say(f"  driver, node agent, lease controller and gateway ({gateway}) running")
            apply_manifest(api, MANIFESTS / "examples" / "two-models.yaml", NAMESPACE)
            core = client.CoreV1Api(api)

            def engines_ready() -> bool:
                pods = [core.read_namespaced_pod(n, NAMESPACE) for n in ("model-a", "model-b")]
                return all(any(c.type == "Ready" and c.status == "True"
                               for c in p.status.conditions or []) for p in pods)

            eventually(engines_ready, timeout=90, what="both engines running")
            # Both engines start awake, as vLLM does; the controller puts one to sleep.
            eventually(lambda: _lease(api)["holder"] != "-", timeout=60,
                       what="the controller reconciled the GPU")
            say(f"  the controller reconciled: {_lease(api)['model']} awake, the other asleep")
            say("  both engines running on the same GPU; sending requests through the gateway:")
            asyncio.run(_conversation(api, gateway, node.controller_url(), TOKEN, args.rounds))
            say(f"\n  GPU lease now: {_lease(api)}")
            if args.keep:
                say(f"\n  export KUBECONFIG={cluster.kubeconfig}\n"
                    "  kubectl get resourceslices,resourceclaims -A; kubectl -n demo get pods\n"
                    "  press Ctrl-C to stop")
                try:
                    while True:
                        time.sleep(3600)
                except KeyboardInterrupt:
                    pass
        finally:
            node.close()
            api.close()
    say("  stopped everything the demo started.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
