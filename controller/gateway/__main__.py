"""``rota-controller gateway`` (also ``python -m controller.gateway``): parse settings, set
up logging, serve. Errors say ``rota-controller gateway``, the name its usage gives."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any

from controller.gateway import app
from controller.gateway.settings import PROG, SettingsError, load
from rota.kit import logs
from rota.kit.kube import check_kubeconfig


def _run(coro: Coroutine[Any, Any, None]) -> None:
    """Serve on uvloop where it is installed: it roughly halves the gateway's CPU time per
    request, which is what a burst of streams waits on; the standard loop otherwise."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    uvloop.run(coro)


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load(argv)
        check_kubeconfig(settings.kubeconfig)
    except SettingsError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    from rota.kit.kube import ClientAgent, use_client_agent
    use_client_agent(ClientAgent(component="rota-gateway", qps=settings.api_qps,
                                 burst=settings.api_burst))
    try:
        _run(app.serve(settings))
    except app.StartupError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
