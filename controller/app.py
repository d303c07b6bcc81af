"""The lease controller process: wiring, signals, and an orderly stop.

Tasks under one TaskGroup: the election (acquire and renew the node's controller Lease),
the node controller (reconcile, then serve switches while leading). The activation API
listens from the start; it answers ``not_leader`` until the instance leads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from controller.activation import make_app
from controller.device import DeviceReader
from controller.election import Election
from controller.gateway.credentials import ApiKeys, SecretFile, reload_forever
from controller.kube import ControllerKube
from controller.node import NodeController
from controller.settings import LeaseSettings
from controller.urls import advertised_url
from driver.kube import load_api_client
from driver.listen import DUAL_STACK, split_host_port, start_site

log = logging.getLogger(__name__)


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
    engine_token: str | None = None
    if settings.engine_token_file is not None:
        engine_secret = SecretFile(settings.engine_token_file)
        await engine_secret.load()
        engine_token = engine_secret.lines[0] if engine_secret.lines else None
    api = load_api_client(settings.kubeconfig)
    kube = ControllerKube(api, timeout_s=settings.timeouts.lease_s)
    await kube.ensure_namespace(settings.namespace)
    device = DeviceReader(settings.inspect_socket, timeout_s=settings.timeouts.inspect_s)
    timeout = aiohttp.ClientTimeout(total=None, connect=5)
    connector = aiohttp.TCPConnector(limit=256)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        host, port = split_host_port(settings.listen)
        runner: web.AppRunner | None = None
        try:
            election = Election(kube=kube, namespace=settings.namespace,
                                node=settings.node_name, identity=settings.identity,
                                duration_s=settings.election_lease_s, activation_url="")
            node = NodeController(settings=settings, kube=kube, election=election,
                                  device=device, session=session, engine_token=engine_token)
            app = make_app(node, callers=ApiKeys(callers))
            runner = web.AppRunner(app, access_log=None)
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
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(election.run(life.stop), name="election")
                tasks.create_task(node.run(life.stop), name="node-controller")
                if callers is not None:  # a rotated Secret reaches the volume, not the process
                    reload = tasks.create_task(reload_forever([callers], settings.token_reload_s),
                                               name="token-reload")
                life.ready.set()
                await life.stop.wait()
                if callers is not None:
                    reload.cancel()
        finally:
            if runner is not None:
                await runner.cleanup()
            await device.close()
            api.close()
