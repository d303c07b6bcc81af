"""The engine guard's process: serve until stopped, or (entrypoint mode) for as long as
the engine it started runs.

Entrypoint mode (a command after ``--``): the guard starts the engine with the guard's
environment, serves while it runs, forwards SIGTERM and SIGINT to it, kills it when it has
not exited ``shutdown_grace_s`` after that, and exits with the engine's status (so the pod
restarts a crashed engine as it would without the guard). Sidecar mode (no command): the
guard serves until SIGTERM.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Sequence

from aiohttp import web

from controller.credentials import Credential
from controller.guard.proxy import make_app
from controller.guard.settings import GuardSettings
from driver.listen import start_site

__all__ = ["run"]

log = logging.getLogger(__name__)


async def _credentials(settings: GuardSettings) -> tuple[Credential, Credential | None]:
    control = Credential(settings.control_token_file, recheck_s=settings.token_recheck_s)
    await control.load()
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
    control, api_key = await _credentials(settings)
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
            child = await asyncio.create_subprocess_exec(*command)
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
