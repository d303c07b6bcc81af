"""Wiring: the application factory tests call, and the server loop ``__main__`` runs.

:func:`make_app` builds every part from the settings and hangs it on the application under
typed keys (:mod:`controller.gateway.keys`). Lifecycles are cleanup contexts: the secret
files and the model binding file (read before the first request, then re-read
periodically), the one ``ClientSession`` every engine and controller call shares, and the
routing source feeding the routing state, supervised so a crash restarts it after a
bounded, jittered backoff.

:func:`serve` runs the application until SIGTERM or SIGINT, then drains without dropping
work: readiness fails at once and every answer from then on closes its connection (so
clients reconnect through the Service, to another replica), the listener stays open for
``shutdown_delay_s`` while endpoints propagate, then closes, and requests in flight (the
longest stream) get ``shutdown_grace_s`` to finish.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import suppress

import aiohttp
from aiohttp import web

from controller.credentials import ApiKeys, SecretFile, reload_forever
from controller.gateway import keys
from controller.gateway.activation import Activator
from controller.gateway.binding import BindingError, BindingFile, ModelBinding
from controller.gateway.dispatch import Dispatcher
from controller.gateway.engine_keys import EngineKeys, KubeSecretReader, SecretReader
from controller.gateway.errors import RotaGatewayError
from controller.gateway.kube_source import KubeSource
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.places import ModelPlaces
from controller.gateway.routes import error_middleware, routes
from controller.gateway.routing import RoutingSource, RoutingState
from controller.gateway.settings import GatewaySettings
from rota.kit.aio import Backoff
from rota.kit.engine_connections import engine_connector
from rota.kit.kube import load_api_client
from rota.kit.listen import start_site

__all__ = ["StartupError", "make_app", "serve"]

log = logging.getLogger(__name__)

_SOURCE_BACKOFF_S = 1.0
_SOURCE_BACKOFF_MAX_S = 30.0


class StartupError(RotaGatewayError, RuntimeError):
    """The gateway cannot start (a secret or binding file cannot be read)."""


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
        counter = app[keys.METRICS].secret_reload_failures

        def failed(secret: SecretFile, exc: OSError) -> None:
            counter.labels("activation_token" if secret is token else "api_keys").inc()

        reloader = asyncio.create_task(reload_forever(files, every_s, failed=failed),
                                       name="secret-reload")
        try:
            yield
        finally:
            reloader.cancel()
            with suppress(asyncio.CancelledError):
                await reloader

    return lifecycle


async def _reload_binding(binding: BindingFile, state: RoutingState, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        try:
            state.set_binding(await binding.load())
        except BindingError as exc:
            log.warning("could not re-read the model binding; keeping the last one",
                        extra={"path": str(binding.path), "error": str(exc)[:300]})


def _binding(binding: BindingFile) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        state = app[keys.STATE]
        try:
            state.set_binding(await binding.load())
        except BindingError as exc:
            raise StartupError(f"model binding: {exc}") from exc
        if state.binding.empty:
            log.warning("no namespace is bound to any model: no model will be served (set "
                        "--serving-namespaces or --model-binding-file)")
        task = None
        if binding.path is not None:
            task = asyncio.create_task(_reload_binding(
                binding, state, app[keys.SETTINGS].secret_reload_s), name="binding-reload")
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task

    return lifecycle


def _clients(token: SecretFile | None, secrets: SecretReader | None, *, kube_secrets: bool
             ) -> Callable[[web.Application], AsyncIterator[None]]:
    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        settings = app[keys.SETTINGS]
        api = None
        reader = secrets
        if reader is None and kube_secrets:
            api = await asyncio.to_thread(load_api_client, settings.kubeconfig)
            reader = KubeSecretReader(api, timeout_s=settings.api_timeout_s)
        # Engines' answers pass through byte for byte: no decompression, no pool limit
        # beyond the model's places (which bound connections per model).
        session = aiohttp.ClientSession(
            connector=engine_connector(limit=0, enable_cleanup_closed=True),
            auto_decompress=False)
        activator = Activator(session, token, timeout_s=settings.activation_timeout_s,
                              connect_timeout_s=settings.activation_connect_timeout_s,
                              attempts=settings.activation_attempts,
                              metrics=app[keys.METRICS])
        engine_keys = EngineKeys(reader, ttl_s=settings.engine_key_ttl_s)
        app[keys.DISPATCHER] = Dispatcher(settings, app[keys.STATE], app[keys.PLACES],
                                          activator, session, app[keys.METRICS], engine_keys)
        try:
            yield
        finally:
            await activator.close()
            await session.close()
            if api is not None:
                await asyncio.to_thread(api.close)

    return lifecycle


async def _supervise(source: RoutingSource, state: RoutingState) -> None:
    pauses = Backoff(first_s=_SOURCE_BACKOFF_S, max_s=_SOURCE_BACKOFF_MAX_S)
    while True:
        try:
            await source.run(state)
            return
        except Exception:
            log.exception("routing source failed; restarting it")
            await pauses.sleep()


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


async def _close_when_stopping(request: web.Request, response: web.StreamResponse) -> None:
    """While draining, every answer closes its connection: the client's next request
    opens a new one, which the Service sends to a replica that is not stopping."""
    if request.app[keys.STOPPING].is_set():
        response.force_close()


def make_app(settings: GatewaySettings, *, routing_source: RoutingSource | None = None,
             secret_reader: SecretReader | None = None) -> web.Application:
    """The gateway as an aiohttp application.

    Args:
        settings: the gateway's settings.
        routing_source: what feeds the routing state; None watches the Kubernetes API
            (:class:`~controller.gateway.kube_source.KubeSource`). Tests pass a
            :class:`~controller.gateway.routing.StaticSource` and change
            ``app[keys.STATE]`` directly.
        secret_reader: where engines' API keys are read; None reads them through the
            Kubernetes API when ``routing_source`` is None too (else: no engine key can be
            read).

    Run it with ``handler_cancellation=True`` (as :func:`serve` and aiohttp's test server
    do), so that a client's disconnect cancels its engine request at once.
    """
    app = web.Application(middlewares=[error_middleware],
                          client_max_size=settings.max_body_bytes)
    state = RoutingState()
    places = ModelPlaces(limit_per_engine=settings.max_concurrency_per_engine,
                          engines=state.engine_count, queue_size=settings.queue_size)
    metrics = GatewayMetrics(places.counts)
    token = SecretFile(settings.activation_token_file) if settings.activation_token_file \
        else None
    client_keys = SecretFile(settings.api_keys_file) if settings.api_keys_file else None
    binding = BindingFile(ModelBinding(namespaces=settings.serving_namespaces),
                          settings.model_binding_file)
    app[keys.SETTINGS] = settings
    app[keys.STATE] = state
    app[keys.PLACES] = places
    app[keys.METRICS] = metrics
    app[keys.API_KEYS] = ApiKeys(client_keys)
    app[keys.STOPPING] = asyncio.Event()
    source = routing_source if routing_source is not None else KubeSource(settings,
                                                                           metrics=metrics)
    app.cleanup_ctx.append(_secrets(token, client_keys, settings.secret_reload_s))
    app.cleanup_ctx.append(_binding(binding))
    app.cleanup_ctx.append(_clients(token, secret_reader,
                                    kube_secrets=routing_source is None))
    app.cleanup_ctx.append(_routing(source))
    app.on_response_prepare.append(_close_when_stopping)
    app.add_routes(routes())
    return app


async def serve(settings: GatewaySettings, *, app: web.Application | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Serve until SIGTERM/SIGINT (or ``stop`` is set), then drain (see the module)."""
    app = app if app is not None else make_app(settings)
    stop = stop if stop is not None else asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    runner = web.AppRunner(app, handler_cancellation=True,
                           shutdown_timeout=settings.shutdown_grace_s)
    try:
        await runner.setup()
        await start_site(runner, settings.host, settings.port)
        log.info("gateway listening", extra={"addresses": [str(a) for a in runner.addresses]})
        await stop.wait()
        app[keys.STOPPING].set()
        log.info("stopping: readiness off; still serving while endpoints catch up",
                 extra={"delay_s": settings.shutdown_delay_s,
                        "grace_s": settings.shutdown_grace_s})
        await asyncio.sleep(settings.shutdown_delay_s)
        log.info("stopping: listener closed; letting requests in flight finish")
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        await runner.cleanup()  # also undoes a startup that failed half-way
        log.info("gateway stopped")
