"""The engine guard's process: serve until stopped, or (entrypoint mode) for as long as
the engine it started runs.

Entrypoint mode (a command after ``--``): the guard starts the engine with the guard's
environment less ``ROTA_CONTROL_TOKEN``, serves while it runs, forwards SIGTERM and SIGINT
to it, kills it when it has not exited ``shutdown_grace_s`` after that, and exits with the
engine's status (so the pod restarts a crashed engine as it would without the guard).
Sidecar mode (no command): the guard serves until SIGTERM.

The control credential is the claim's own control token, which rota's driver writes into
the environment of every container that uses the claim (CDI, ``ROTA_CONTROL_TOKEN``;
:mod:`driver.control_tokens`): one per claim, so what one engine learns opens no other,
and the lease controller sends each engine only its own. The guard's container must use
the claim (``resources.claims``), as the engine's does; without the variable the guard
does not start. In entrypoint mode the engine never sees it (it needs none); as a sidecar,
the engine's container, which uses the claim too, has it: its own claim's, which opens
nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence

from aiohttp import web

from controller.credentials import Credential, FixedCredential
from controller.guard.proxy import make_app
from controller.guard.settings import GuardSettings
from rota.api.control_contract import CONTROL_TOKEN_ENV
from rota.kit.listen import start_site

__all__ = ["MissingControlToken", "engine_environment", "run"]

log = logging.getLogger(__name__)


class MissingControlToken(OSError):
    """The guard's environment has no control token: its container does not use a rota
    claim with an engine config (or the driver is older than per-claim tokens). An
    ``OSError``, so the guard stops at start as for an unreadable credential file."""


def control_credential(environ: Mapping[str, str]) -> FixedCredential:
    """The claim's control token from ``environ``.

    Raises:
        MissingControlToken: the variable is missing or empty.
    """
    value = environ.get(CONTROL_TOKEN_ENV, "").strip()
    if not value:
        raise MissingControlToken(
            f"{CONTROL_TOKEN_ENV} is not set: the guard's container must use the engine's "
            "rota claim (resources.claims), whose CDI environment carries the claim's "
            "control token")
    return FixedCredential(value)


def engine_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The engine's environment: the guard's, less the control token."""
    return {k: v for k, v in environ.items() if k != CONTROL_TOKEN_ENV}


async def _credentials(settings: GuardSettings, environ: Mapping[str, str]
                       ) -> tuple[Credential, Credential | None]:
    control = control_credential(environ)
    api_key = None
    if settings.api_key_file is not None:
        api_key = Credential(settings.api_key_file, recheck_s=settings.token_recheck_s)
        await api_key.load()
    return control, api_key


async def _stop_child(child: asyncio.subprocess.Process, grace_s: float) -> None:
    if child.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(child.wait(), timeout=grace_s)
    except TimeoutError:
        log.warning("the engine did not exit in time; killing it",
                    extra={"pid": child.pid, "grace_s": grace_s})
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()


async def run(settings: GuardSettings, command: Sequence[str] = (), *,
              stop: asyncio.Event | None = None) -> int:
    """Serve; with ``command``, run the engine too. The exit status to return."""
    environ = dict(os.environ)
    control, api_key = await _credentials(settings, environ)
    if not settings.upstream_on_loopback:
        log.warning("the engine's address is not on loopback: its control routes may be "
                    "reachable around the guard", extra={"upstream": settings.upstream})
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(make_app(settings, control=control, api_key=api_key),
                           handler_cancellation=True, handle_signals=False)
    child: asyncio.subprocess.Process | None = None
    try:
        await runner.setup()
        await start_site(runner, settings.host, settings.port)
        log.info("engine guard listening", extra={
            "host": settings.host, "port": runner.addresses[0][1],
            "upstream": settings.upstream, "api_key": api_key is not None})
        if command:
            child = await asyncio.create_subprocess_exec(
                *command, env=engine_environment(environ))
            log.info("engine started", extra={"pid": child.pid, "command": command[0]})
            exited = asyncio.create_task(child.wait(), name="engine")
            stopped = asyncio.create_task(stop.wait(), name="stop")
            await asyncio.wait({exited, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not exited.done():
                await _stop_child(child, settings.shutdown_grace_s)
            code = await exited
            log.info("engine exited", extra={"pid": child.pid, "exit_code": code})
            return code if code >= 0 else 128 - code
        await stop.wait()
        return 0
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if child is not None:
            await _stop_child(child, settings.shutdown_grace_s)
        await runner.cleanup()
        log.info("engine guard stopped")
