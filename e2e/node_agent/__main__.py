"""``python -m e2e.node_agent``: run the node agent for one Node until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

from e2e.node_agent.agent import NodeAgent
from rota.kit.kube import ClientAgent, load_api_client
from rota.kit.logs import configure


async def _run(args: argparse.Namespace) -> None:
    # The kubelet's stand-in names itself, so audit logs and request counts tell its load
    # from rota's components'.
    api = load_api_client(args.kubeconfig, agent=ClientAgent(component="rota-e2e-node-agent"))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    extra = dict(item.split("=", 1) for item in args.env)
    agent = NodeAgent(api=api, node=args.node, registry_dir=args.registry_dir,
                      cdi_root=args.cdi_root, log_dir=args.log_dir, extra_env=extra)
    try:
        await agent.run(stop)
    finally:
        api.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.node_agent",
        description="Play the kubelet's DRA part for one Node of rota's local cluster: "
                    "register DRA drivers, prepare pods' claims over the driver's gRPC "
                    "socket, run the engine simulator with the CDI environment, report pod "
                    "status, unprepare on deletion.")
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--node", required=True)
    parser.add_argument("--registry-dir", type=Path, required=True,
                        help="the kubelet plugins_registry directory to look for drivers in")
    parser.add_argument("--cdi-root", type=Path, required=True)
    parser.add_argument("--log-dir", type=Path, required=True, help="engine logs go here")
    parser.add_argument("--env", action="append", default=[],
                        help="KEY=VALUE added to every engine's environment (repeatable)")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    configure(args.log_level)
    asyncio.run(_run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
