"""The driver process: the one place where its parts are built and wired together.

Start order: NVML and discovery, the ledger restored, the DRA and inspection servers, the
slice publisher's first sync, and last the registration socket, so the kubelet only
learns of the driver once it can serve. Stop order is the reverse; the registration
socket goes first, so the kubelet stops sending calls before the DRA server closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass, field

from aiohttp import web

from driver import DRIVER_NAME
from driver.cdi import ExtraEdits, fake_nvml_edits
from driver.control_tokens import ControlTokens
from driver.devices import discover
from driver.gc import LedgerCollector
from driver.health import HealthMonitor
from driver.inspection import InspectionService
from driver.ledger import Ledger, current_boot_id
from driver.nvml import open_backend
from driver.nvml.api import NvmlBackend
from driver.prepare import Preparer
from driver.probes import make_app
from driver.publisher import SlicePublisher
from driver.rpc.dra import DraService
from driver.rpc.registration import RegistrationService
from driver.settings import DriverSettings, NvmlBackendKind
from driver.slices import SharingMode
from driver.startgate import StartGate, load_or_create_key, prepare_start_gate_dir
from rota.kit.aio import wait_any
from rota.kit.errors import ConfigError
from rota.kit.kube import Kube, load_api_client
from rota.kit.listen import split_host_port, start_site
from rota.kit.sockets import UnixServer, drop_link, point_link

log = logging.getLogger(__name__)


@dataclass
class Lifecycle:
    """Events a caller (a test, an embedding demo) can wait on or set."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    ready: asyncio.Event = field(default_factory=asyncio.Event)


def make_backend(settings: DriverSettings) -> NvmlBackend:
    if settings.nvml_backend is NvmlBackendKind.FAKE:
        if settings.fake_nvml_fixture is None:
            raise ConfigError("--nvml-backend=fake needs --fake-nvml-fixture")
        return open_backend(settings.fake_nvml_fixture, settings.fake_nvml_proc_dir)
    return open_backend(None, None)


def cdi_edits(settings: DriverSettings) -> ExtraEdits | None:
    """With the fake NVML backend, engines get its process registry through their CDI
    spec, as a real engine's memory shows in NVML without anything mounted."""
    if settings.nvml_backend is NvmlBackendKind.FAKE and settings.fake_nvml_proc_dir:
        return fake_nvml_edits(settings.fake_nvml_proc_dir)
    return None


async def run(settings: DriverSettings, lifecycle: Lifecycle | None = None,
              backend: NvmlBackend | None = None) -> None:
    life = lifecycle or Lifecycle()
    backend = backend or make_backend(settings)
    await asyncio.to_thread(backend.init)
    try:
        await _serve(settings, life, backend)
    finally:
        await asyncio.to_thread(backend.shutdown)


async def _serve(settings: DriverSettings, life: Lifecycle, backend: NvmlBackend) -> None:
    gpus = await asyncio.to_thread(discover, backend)
    log.info("discovered GPUs", extra={"node": settings.node_name,
                                       "gpus": [f"{g.name}:{g.uuid}" for g in gpus]})
    api = load_api_client(settings.kubeconfig)
    kube = Kube(api, timeout_s=settings.api_timeout_s)
    publisher = SlicePublisher(kube=kube, node_name=settings.node_name, gpus=gpus,
                               mode=SharingMode(settings.sharing_mode),
                               engines=settings.engines_per_gpu,
                               resync_s=settings.slice_resync_s)
    # The kubelet creates <root>/plugins, not rota's directory in it.
    await asyncio.to_thread(settings.plugin_data_dir.mkdir, mode=0o750, parents=True,
                            exist_ok=True)
    boot_id = await asyncio.to_thread(current_boot_id, settings.proc_root)
    if settings.start_gate_dir is not None:
        await asyncio.to_thread(prepare_start_gate_dir, settings.start_gate_dir)
    # The node key exists whether or not the start gate is on: every claim with an engine
    # config gets a control token derived from it.
    node_key = await asyncio.to_thread(load_or_create_key, settings.start_gate_key_path)
    control = ControlTokens(node_key)
    start_gate = None if settings.start_gate_dir is None else StartGate(
        settings.start_gate_dir, node_key)
    preparer = Preparer(kube=kube, ledger=Ledger(settings.ledger_path, boot_id=boot_id),
                        cdi_root=settings.cdi_root, dev_root=settings.dev_root,
                        driver_name=DRIVER_NAME, pool=settings.node_name,
                        devices=publisher.devices, lock_path=settings.lock_path,
                        lock_timeout_s=settings.lock_timeout_s, cdi_edits=cdi_edits(settings),
                        dev_view=settings.dev_root_mount, start_gate=start_gate,
                        control=control)
    await preparer.restore()
    collector = LedgerCollector(preparer=preparer, kube=kube, node_name=settings.node_name,
                                driver=DRIVER_NAME, pool=settings.node_name)
    health = HealthMonitor(backend=backend, pool=settings.node_name, devices=publisher.devices,
                           on_change=publisher.set_health)
    inspection = InspectionService(
        backend=backend, gpus=gpus, proc_root=settings.proc_root,
        pods_from_environment=settings.nvml_backend is NvmlBackendKind.FAKE,
        start_gate=start_gate, control=control)
    registration = RegistrationService(driver_name=DRIVER_NAME, dra_endpoint=settings.dra_socket)

    dra_server = UnixServer(settings.dra_socket,
                            [*DraService(preparer).handlers(), *health.handlers()])
    inspect_server = UnixServer(settings.inspect_listen_socket, [inspection.handler()],
                                mode=0o660)
    inspect_link = settings.inspect_socket != settings.inspect_listen_socket
    reg_server = UnixServer(settings.registration_socket, [registration.handler()])

    def ready() -> str:
        if not publisher.synced.is_set():
            return "slices not published yet"
        return ""

    runner = web.AppRunner(make_app(registration_socket=settings.registration_socket,
                                    dra_socket=settings.dra_socket, ready=ready,
                                    wedged=preparer.stalled),
                           access_log=None)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, life.stop.set)
    await runner.setup()
    host, port = split_host_port(settings.http_address)
    try:
        await start_site(runner, host or "127.0.0.1", port)
        await dra_server.start()
        await inspect_server.start()
        if inspect_link:
            point_link(settings.inspect_socket, settings.inspect_listen_socket)
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(publisher.run(life.stop), name="slice-publisher")
            tasks.create_task(health.run(life.stop), name="health-monitor")
            tasks.create_task(collector.run(life.stop), name="ledger-gc")
            await wait_any(publisher.synced, life.stop)
            await reg_server.start()
            life.ready.set()
            log.info("driver ready", extra={"node": settings.node_name,
                                            "mode": publisher.mode.value,
                                            "dra_socket": str(settings.dra_socket)})
            await life.stop.wait()
            log.info("driver stopping", extra={"node": settings.node_name})
    finally:
        await reg_server.stop(1)
        if inspect_link:
            drop_link(settings.inspect_socket, settings.inspect_listen_socket)
        await inspect_server.stop(1)
        await dra_server.stop(5)
        await runner.cleanup()
        api.close()
