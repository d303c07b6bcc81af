"""Wiring: the application factory tests call, and the server loop ``__main__`` runs.

:func:`make_app` builds every part from the settings and hangs it on the application under
typed keys (:mod:`controller.gateway.keys`). Lifecycles are cleanup contexts: the secret
files (read before the first request, then re-read periodically), the one
``ClientSession`` every engine and controller call shares, and the routing source feeding
the routing state, supervised so a crash restarts it after a bounded backoff.

:func:`serve` runs the application until SIGTERM or SIGINT: readiness fails first, then
requests in flight get ``shutdown_grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import suppress

import aiohttp
from aiohttp import web

from controller.gateway import keys
from controller.gateway.activation import Activator
from controller.gateway.admission import Admission
from controller.gateway.credentials import ApiKeys, SecretFile, reload_forever
from controller.gateway.dispatch import Dispatcher
from controller.gateway.kube_source import KubeSource
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.routes import error_middleware, routes
from controller.gateway.routing import RoutingSource, RoutingState
from controller.gateway.settings import GatewaySettings

__all__ = ["StartupError", "make_app", "serve"]

log = logging.getLogger(__name__)

_SOURCE_BACKOFF_S = 1.0
_SOURCE_BACKOFF_MAX_S = 30.0
SHUTDOWN_GRACE_S = 30.0


class StartupError(RuntimeError):
    """The gateway cannot start (a secret file cannot be read)."""


def _secrets(token: SecretFile | None, client_keys: SecretFile | None,
             every_s: float) -> Callable[[web.Application], AsyncIterator[None]]:
    files = [f for f in (token, client_keys) if f is not None]

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        for secret in files:
            try:
                await secret.load()
            except OSError as exc:
                raise StartupError(f"cannot read secret file {secret.path}: {exc}") from exc
        if token is None:
            log.warning("no activation token file: activation calls carry no credential")
        reloader = asyncio.create_task(reload_forever(files, every_s), name="secret-reload")
        try:
            yield
        finally:
            reloader.cancel()
            with suppress(asyncio.CancelledError):
                await reloader

    return lifecycle


def _clients(token: SecretFile | None) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        settings = app[keys.SETTINGS]
        # Engines' answers pass through byte for byte: no decompression, no pool limit
        # beyond admission's (which bounds connections per model).
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, enable_cleanup_closed=True),
            auto_decompress=False)
        activator = Activator(session, token, timeout_s=settings.activation_timeout_s,
                              attempts=settings.activation_attempts,
                              retry_after=settings.retry_after_s, metrics=app[keys.METRICS])
        app[keys.DISPATCHER] = Dispatcher(settings, app[keys.STATE], app[keys.ADMISSION],
                                          activator, session, app[keys.METRICS])
        try:
            yield
        finally:
            await activator.close()
            await session.close()

    return lifecycle


async def _supervise(source: RoutingSource, state: RoutingState) -> None:
    backoff = _SOURCE_BACKOFF_S
    while True:
        try:
            await source.run(state)
            return
        except Exception:
            log.exception("routing source failed; restarting it", extra={"backoff_s": backoff})
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, _SOURCE_BACKOFF_MAX_S)


def _routing(source: RoutingSource) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(_supervise(source, app[keys.STATE]), name="routing-source")
        try:
            yield
        finally:
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task

    return lifecycle


def make_app(settings: GatewaySettings, *,
             routing_source: RoutingSource | None = None) -> web.Application:
    """The gateway as an aiohttp application.

    Args:
        settings: the gateway's settings.
        routing_source: what feeds the routing state; None watches the Kubernetes API
            (:class:`~controller.gateway.kube_source.KubeSource`). Tests pass a
            :class:`~controller.gateway.routing.StaticSource` and change
            ``app[keys.STATE]`` directly.

    Run it with ``handler_cancellation=True`` (as :func:`serve` and aiohttp's test server
    do), so that a client's disconnect cancels its engine request at once.
    """
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=settings.max_body_bytes)
    state = RoutingState()
    admission = Admission(limit=settings.max_concurrency, queue_size=settings.queue_size,
                          retry_after=settings.retry_after_s)
    metrics = GatewayMetrics(admission.counts)
    token = SecretFile(settings.activation_token_file) if settings.activation_token_file \
        else None
    client_keys = SecretFile(settings.api_keys_file) if settings.api_keys_file else None
    app[keys.SETTINGS] = settings
    app[keys.STATE] = state
    app[keys.ADMISSION] = admission
    app[keys.METRICS] = metrics
    app[keys.API_KEYS] = ApiKeys(client_keys)
    app[keys.STOPPING] = asyncio.Event()
    source = routing_source if routing_source is not None else KubeSource(settings,
                                                                           metrics=metrics)
    app.cleanup_ctx.append(_secrets(token, client_keys, settings.secret_reload_s))
    app.cleanup_ctx.append(_clients(token))
    app.cleanup_ctx.append(_routing(source))
    app.add_routes(routes())
    return app


async def serve(settings: GatewaySettings, *, app: web.Application | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set), then shut down gracefully."""
    app = app if app is not None else make_app(settings)
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S)
    try:
        await runner.setup()
        site = web.TCPSite(runner, settings.host, settings.port)
        await site.start()
        log.info("gateway listening", extra={"addresses": [str(a) for a in runner.addresses]})
        await stop.wait()
        log.info("stopping: readiness off, letting requests in flight finish")
        app[keys.STOPPING].set()
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await runner.cleanup()  # also undoes a startup that failed half-way
