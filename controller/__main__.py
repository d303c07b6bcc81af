"""``rota-controller {lease,gateway} [flags]`` (also ``python -m controller``): run the lease
controller or the gateway. Usage, errors and ``--version`` name it ``rota-controller``, the
installed script, like every other rota command."""

from __future__ import annotations

import asyncio
import sys

from rota.kit.errors import ConfigError
from rota.kit.kube import check_kubeconfig
from rota.kit.kube_client import version
from rota.kit.logs import configure

PROG = "rota-controller"
USAGE = f"""usage: {PROG} {{lease,gateway}} [--help] [--version] [flags]

  lease     the lease controller of one node (one awake engine per GPU)
  gateway   the OpenAI-compatible gateway (one per cluster, several replicas)
"""


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--version"]:
        print(f"{PROG} {version()}")
        return 0
    if not args or args[0] not in ("lease", "gateway"):
        print(USAGE, file=sys.stderr if args[:1] not in (["-h"], ["--help"]) else sys.stdout)
        return 0 if args[:1] in (["-h"], ["--help"]) else 2
    command, rest = args[0], args[1:]
    if command == "gateway":
        from controller.gateway.__main__ import main as gateway_main

        return gateway_main(rest)
    from controller.lease import app, settings

    try:
        config = settings.load(rest)
        check_kubeconfig(config.kubeconfig)
    except ConfigError as exc:
        print(f"{PROG} lease: {exc}", file=sys.stderr)
        return 2
    configure(config.log_level)
    from rota.kit.kube import ClientAgent, use_client_agent
    use_client_agent(ClientAgent(component="rota-controller", qps=config.api_qps,
                                 burst=config.api_burst))
    asyncio.run(app.run(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
