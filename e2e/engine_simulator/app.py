"""Wiring: the application factory tests use, and the server loop ``__main__`` runs."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from aiohttp import web
from aiohttp.typedefs import Middleware

from e2e.engine_simulator.control_api import control_routes, health_routes, release_routes
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.errors import error_middleware
from e2e.engine_simulator.extra_api import extra_routes
from e2e.engine_simulator.http_guards import (
    api_key_middleware,
    dead_engine_middleware,
    reused_connection_middleware,
)
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.memory import MemoryHolder, make_memory
from e2e.engine_simulator.metrics_api import metrics_routes
from e2e.engine_simulator.omni_api import omni_routes
from e2e.engine_simulator.openai_api import openai_routes
from e2e.engine_simulator.recorder import recorder_middleware
from e2e.engine_simulator.settings import Settings
from e2e.engine_simulator.sim_api import sim_routes
from e2e.engine_simulator.surface_api import surface_routes

__all__ = ["ENGINE_KEY", "create_app", "run"]

log = logging.getLogger(__name__)


async def _engine_lifecycle(app: web.Application) -> AsyncIterator[None]:
    engine = app[ENGINE_KEY]
    await engine.start()
    try:
        yield
    finally:
        await engine.close()


async def _drain(app: web.Application) -> None:
    engine = app[ENGINE_KEY]
    await engine.shutdown(engine.settings.shutdown_grace_seconds)


def create_app(
    settings: Settings,
    *,
    memory: MemoryHolder | None = None,
    exit_process: Callable[[int], object] = os._exit,
) -> web.Application:
    """The simulator as an aiohttp application (vLLM's development routes only with
    ``settings.dev_mode``, as with ``VLLM_SERVER_DEV_MODE=1``).

    Args:
        settings: the knobs.
        memory: the memory holder; None builds the one ``settings.memory_backend`` names.
        exit_process: how a simulated crash ends the process (tests pass a recorder).
    """
    pid = settings.nvml_pid or os.getpid()
    holder = memory if memory is not None else make_memory(settings, pid=pid)
    app = web.Application(handler_args={"keepalive_timeout": settings.keep_alive_seconds})
    # Recording comes first: a hostile engine sees every header, refused requests' too.
    middlewares: list[Middleware] = [recorder_middleware(app), reused_connection_middleware()]
    if settings.api_key is not None:
        middlewares.append(api_key_middleware(settings.api_key.get_secret_value()))
    middlewares += [dead_engine_middleware, error_middleware]
    # uvicorn's keep-alive: idle connections are closed after keep_alive_seconds.
    app.middlewares.extend(middlewares)
    app[ENGINE_KEY] = Engine(settings, holder, pid=pid, exit_process=exit_process)
    app.add_routes(health_routes())
    app.add_routes(release_routes())
    if settings.dev_mode:  # VLLM_SERVER_DEV_MODE=1
        app.add_routes(control_routes())
    app.add_routes(metrics_routes())
    app.add_routes(openai_routes())
    app.add_routes(extra_routes())
    app.add_routes(surface_routes())
    app.add_routes(sim_routes())
    if settings.omni:
        app.add_routes(omni_routes())
    app.cleanup_ctx.append(_engine_lifecycle)
    app.on_shutdown.append(_drain)
    return app


def _write_port_file(path: Path, port: int) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as out:
            out.write(f"{port}\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


async def run(settings: Settings, *, stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM or SIGINT (or ``stop`` is set), then shut down gracefully.

    Shutdown stops accepting connections, lets running generations finish for
    ``shutdown_grace_seconds``, aborts the rest, and unregisters the GPU memory.
    """
    stop = stop if stop is not None else asyncio.Event()
    if settings.start_seconds:
        log.info("engine simulator starting", extra={"start_seconds": settings.start_seconds})
        await asyncio.sleep(settings.start_seconds)  # imports and model load, as vLLM's
    app = create_app(settings)
    runner = web.AppRunner(app, handle_signals=False,
                           shutdown_timeout=settings.shutdown_grace_seconds + 5.0)
    await runner.setup()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    try:
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        port = int(runner.addresses[0][1])
        if settings.port_file is not None:
            await asyncio.to_thread(_write_port_file, settings.port_file, port)
        log.info("engine simulator listening", extra={
            "host": settings.host, "port": port, "model": settings.model,
            "url": f"http://{settings.host}:{port}", "omni": settings.omni,
            "memory_backend": settings.memory_backend,
        })
        if settings.faults.crash_now:
            app[ENGINE_KEY].crash("crash_now at start")
        for sig in signals:
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("engine simulator stopping")
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        if settings.port_file is not None:
            settings.port_file.unlink(missing_ok=True)
        log.info("engine simulator stopped")
