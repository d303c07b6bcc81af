"""The lease controller process: wiring, signals, and an orderly stop.

Tasks under one TaskGroup: the election (acquire and renew the node's controller Lease),
the node controller (its GPU workers reconcile, then serve switches while leading). The
activation API listens from the start; it answers ``not_leader`` until the instance leads.

Stopping (SIGTERM) goes in this order: the workers stop taking work and answer every
waiter; the step in flight finishes within ``--shutdown-grace-s`` while the election keeps
renewing the Lease; then the Lease is released, or, when a step had to be cut short, left
to expire so that the next instance waits until what was sent has landed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from controller.credentials import ApiKeys, SecretFile, reload_forever
from controller.lease import starts
from controller.lease.activation import make_app
from controller.lease.cache import NodeCache
from controller.lease.device import DeviceReader
from controller.lease.election import Election
from controller.lease.kube import ControllerKube
from controller.lease.node import NodeController
from controller.lease.settings import LeaseSettings
from controller.lease.visible_state_writer import VisibleStateKube, VisibleStateWriter
from controller.urls import advertised_url
from rota.kit.aio import Backoff, retry
from rota.kit.engine_connections import engine_connector
from rota.kit.errors import KubeError
from rota.kit.kube import load_api_client
from rota.kit.listen import DUAL_STACK, split_host_port, start_site

log = logging.getLogger(__name__)

VISIBLE_FLUSH_S = 3.0
"""How long a stopping controller lets the visible-state writer finish its writes."""


@dataclass
class Lifecycle:
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    url: str = ""


async def run(settings: LeaseSettings, life: Lifecycle | None = None) -> None:
    life = life or Lifecycle()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, life.stop.set)
    callers = SecretFile(settings.token_file) if settings.token_file else None
    if callers is not None:
        await callers.load()
    else:
        log.warning("the activation API runs without a token; set --token-file in production")
    api = load_api_client(settings.kubeconfig)
    kube = ControllerKube(api, timeout_s=settings.timeouts.lease_s)
    # An API server that does not answer at start (a restart beside it, a slow network) is
    # waited for, boundedly; then the process exits and the kubelet restarts it.
    await retry(lambda: kube.ensure_namespace(settings.namespace), retry_on=(KubeError,),
                backoff=Backoff(first_s=0.5, max_s=5.0, attempts=8),
                on_retry=lambda exc, pause: log.warning(
                    "the API server did not answer at start; trying again",
                    extra={"node": settings.node_name, "error": str(exc),
                           "pause_s": round(pause, 2)}))
    device = DeviceReader(settings.inspect_socket, timeout_s=settings.timeouts.inspect_s)
    cache = NodeCache(api, node=settings.node_name, api_timeout_s=settings.timeouts.lease_s,
                      lease_namespace=settings.namespace)
    cache.start()
    timeout = aiohttp.ClientTimeout(total=None, connect=5)
    connector = engine_connector()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        host, port = split_host_port(settings.listen)
        runner: web.AppRunner | None = None
        gate: starts.StartServer | None = None
        try:
            # The election renews through a client of its own, so its token bucket never
            # queues a renewal behind a start's or a relist's requests (a renewal later
            # than 2/3 of the Lease's duration gives the node up).
            election_kube = ControllerKube(load_api_client(settings.kubeconfig),
                                           timeout_s=settings.timeouts.lease_s)
            election = Election(kube=election_kube, namespace=settings.namespace,
                                node=settings.node_name, identity=settings.identity,
                                duration_s=settings.election_lease_s, activation_url="")
            visible = None
            if settings.visible_state:
                visible = VisibleStateWriter(
                    VisibleStateKube(api, timeout_s=settings.timeouts.lease_s),
                    instance=settings.identity)
            node = NodeController(settings=settings, kube=kube, election=election,
                                  device=device, session=session, cache=cache,
                                  visible=visible)
            app = make_app(node, callers=ApiKeys(callers))
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
            await runner.setup()
            await start_site(runner, host or DUAL_STACK, port)
            bound = runner.addresses[0][1] if runner.addresses else port
            life.url = settings.advertise_url or advertised_url(
                host, bound, host=settings.advertise_host)
            # Known only after binding (port 0); the election writes it on its first renew.
            election.activation_url = life.url
            log.info("lease controller listening", extra={"node": settings.node_name,
                                                          "url": life.url,
                                                          "identity": settings.identity})
            if settings.start_socket is not None:
                # Its own socket; the gates' path leads to the leader's (a twin that
                # starts and exits beside the leader never leaves the gates a dead path).
                gate = await starts.serve(node, settings.start_socket,
                                          instance=election.instance,
                                          leading=election.is_leader)
            released = asyncio.Event()
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(election.run(released), name="election")
                tasks.create_task(node.run(life.stop), name="node-controller")
                tasks.create_task(cache.wait_synced(), name="cache-sync")
                visible_stop = asyncio.Event()
                writer: asyncio.Task[None] | None = None
                if visible is not None:  # off the switch's path; flushed after the drain
                    writer = tasks.create_task(visible.run(visible_stop), name="visible-state")
                if callers is not None:  # a rotated Secret reaches the volume, not the process
                    reload = tasks.create_task(reload_forever([callers], settings.token_reload_s),
                                               name="token-reload")
                life.ready.set()
                await life.stop.wait()
                log.info("stopping: no new work; letting the step in flight finish",
                         extra={"node": settings.node_name,
                                "grace_s": settings.shutdown_grace_s})
                election.keep_on_exit = not await node.drain(settings.shutdown_grace_s)
                visible_stop.set()
                released.set()
                if writer is not None:
                    # Its last flush is bounded: an API server that does not answer never
                    # holds up a stopping controller (what is left is only visible state).
                    done, _ = await asyncio.wait({writer}, timeout=VISIBLE_FLUSH_S)
                    if not done:
                        log.warning("stopping with visible state unwritten",
                                    extra={"node": settings.node_name})
                        writer.cancel()
                if callers is not None:
                    reload.cancel()
        finally:
            if gate is not None:
                await gate.cleanup()
            if runner is not None:
                await runner.cleanup()
            await cache.stop()
            await device.close()
            api.close()
