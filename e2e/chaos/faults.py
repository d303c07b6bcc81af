"""The faults a campaign injects, each as real as this machine allows: engine faults through
the simulator's ``/sim/faults`` (the ones vLLM shows: a wake that runs out of memory, a
hung wake, a sleep that lies or is ignored, a crash, an abandoned sleep that fires later),
process faults by signal (SIGKILL and SIGTERM of a lease controller mid-step, a second
instance of one identity), API faults through the relay (stalls, resets) and by writing
the Lease as another writer would, and engine starts during switches. Two are the shapes of
the December review's failover findings: a twin controller that starts and exits, then an
engine start (F4), and a controller SIGKILLed between a slow starter's grant and its first
GPU allocation, the start outlasting the election Lease (F3).

Each fault says whether it took effect (an engine that could not be reached, a Lease that
was not there: it did not, and it is not counted) and returns the coroutine that undoes it
(None when nothing is left to undo).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from kubernetes import client

from e2e.chaos.evidence import engine_log
from e2e.chaos.rig import NodeRig, Rig, slow_starters
from e2e.harness.objects import ROTA_NAMESPACE, node_gpu_leases
from e2e.harness.scenario import Engine, set_faults
from rota.api import naming
from rota.kit.aio import Backoff

__all__ = ["CATALOGUE", "Fault", "Injected"]

Undo = Callable[[], Awaitable[None]] | None


@dataclass(frozen=True)
class Injected:
    took_effect: bool
    undo: Undo = None


NOT_INJECTED = Injected(False)
Inject = Callable[[Rig, NodeRig, random.Random, aiohttp.ClientSession], Awaitable[Injected]]


@dataclass(frozen=True)
class Fault:
    name: str
    weight: float
    inject: Inject


def _engine(node: NodeRig, rng: random.Random) -> Engine:
    return rng.choice(node.engines)


def _sim_fault(name: str) -> Inject:
    async def inject(rig: Rig, node: NodeRig, rng: random.Random,
                     session: aiohttp.ClientSession) -> Injected:
        engine = _engine(node, rng)
        try:
            await set_faults(session, engine, **{name: True})
        except (aiohttp.ClientError, TimeoutError):
            return NOT_INJECTED

        async def undo() -> None:
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                await set_faults(session, engine, **{name: False})
        return Injected(True, undo)
    return inject


async def _engine_crash(rig: Rig, node: NodeRig, rng: random.Random,
                        session: aiohttp.ClientSession, *, engine: Engine | None = None
                        ) -> Injected:
    """The engine process dies; the node restarts it (restartPolicy Always)."""
    try:
        await set_faults(session, engine or _engine(node, rng), crash_now=True)
    except aiohttp.ServerDisconnectedError:
        return Injected(True)  # it died answering
    except (aiohttp.ClientError, TimeoutError):
        return NOT_INJECTED
    return Injected(True)


async def _abandoned_sleep(rig: Rig, node: NodeRig, rng: random.Random,
                           session: aiohttp.ClientSession) -> Injected:
    """A client asks an engine to sleep and gives up at once (vLLM keeps the sleep
    registered and fires it when the engine next goes idle)."""
    engine = _engine(node, rng)
    try:
        async with session.post(f"{engine.url}/sleep?level=1&mode=wait",
                                timeout=aiohttp.ClientTimeout(total=0.02)):
            return Injected(True)  # answered at once: a plain sleep, not an abandoned one
    except TimeoutError:
        return Injected(True)  # sent, and given up on
    except aiohttp.ClientError:
        return NOT_INJECTED


def _controller_signal(sig: signal.Signals) -> Inject:
    async def inject(rig: Rig, node: NodeRig, rng: random.Random,
                     session: aiohttp.ClientSession) -> Injected:
        if not node.signal_controller(sig):
            return NOT_INJECTED

        return Injected(True)  # the campaign restarts it once it has exited
    return inject


async def _second_instance(rig: Rig, node: NodeRig, rng: random.Random,
                           session: aiohttp.ClientSession) -> Injected:
    """Another process with the same identity (a restart racing the old one)."""
    twin = node.start_controller(rig.options)

    async def undo() -> None:
        twin.stop()
        node.reap()
    return Injected(True, undo)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


async def _log_says(path: Path, offset: int, needle: str, *, timeout_s: float) -> bool:
    """Whether ``needle`` shows in ``path`` after byte ``offset`` within ``timeout_s``."""
    def said() -> bool:
        try:
            with path.open("rb") as source:
                source.seek(offset)
                return needle.encode() in source.read()
        except FileNotFoundError:
            return False

    deadline = asyncio.get_running_loop().time() + timeout_s
    for pause in Backoff(first_s=0.02, max_s=0.2).delays():
        if await asyncio.to_thread(said):
            return True
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(pause)
    return False


TWIN = "controller-twin"


async def _twin_then_engine_restart(rig: Rig, node: NodeRig, rng: random.Random,
                                    session: aiohttp.ClientSession) -> Injected:
    """F4's shape: a second instance (a surge pod's, another identity) starts beside the
    leader, serves its start gate and exits; then an engine restarts, and its start must
    still reach the leader through the gates' path (else it waits at its gate for ever and
    the campaign ends with an engine that cannot be read)."""
    log_path = node.node.dirs.logs / f"controller-{TWIN}.log"
    offset = await asyncio.to_thread(_size, log_path)
    twin = node.start_controller(rig.options, identity=TWIN)
    try:
        up = await _log_says(log_path, offset, "start gate listening", timeout_s=30)
    finally:
        await asyncio.to_thread(twin.stop)
        node.reap()
    if not up:
        return NOT_INJECTED
    return await _engine_crash(rig, node, rng, session)


async def _slow_start_failover(rig: Rig, node: NodeRig, rng: random.Random,
                               session: aiohttp.ClientSession) -> Injected:
    """F3's shape: a slow starter (it shows no GPU process and answers nothing for longer
    than the election Lease) restarts; once its gate is granted the start, the controller
    is SIGKILLed. The next instance finds the GPU Lease ``starting`` and a newcomer that
    is silent and holds nothing yet: it must keep it unsettled, not wake the old holder
    beside it (the slow starter's awake budget fits beside another's, so two awake are
    seen, not an out-of-memory start)."""
    engines = slow_starters(node)
    if not engines:
        return NOT_INJECTED
    engine = rng.choice(engines)
    log_path = engine_log(node.node.dirs.logs, engine)
    offset = await asyncio.to_thread(_size, log_path)
    crashed = await _engine_crash(rig, node, rng, session, engine=engine)
    if not crashed.took_effect:
        return NOT_INJECTED
    # the node agent's restart back-off reaches 10 s, then the switch into the start
    if not await _log_says(log_path, offset, "start slot granted", timeout_s=60):
        return NOT_INJECTED
    return Injected(node.signal_controller(signal.SIGKILL))


async def _api_stall(rig: Rig, node: NodeRig, rng: random.Random,
                     session: aiohttp.ClientSession) -> Injected:
    node.relay.stall_s = rng.choice([0.5, 2.0, 12.0])

    async def undo() -> None:
        node.relay.stall_s = 0.0
    return Injected(True, undo)


async def _api_reset(rig: Rig, node: NodeRig, rng: random.Random,
                     session: aiohttp.ClientSession) -> Injected:
    return Injected(node.relay.cut() > 0)


async def _lease_moved(rig: Rig, node: NodeRig, rng: random.Random,
                       session: aiohttp.ClientSession) -> Injected:
    """Another writer raises the GPU Lease's fencing number under the controller."""
    coordination = client.CoordinationV1Api(rig.api)

    def move() -> int:
        moved = 0
        # A foreign writer: it raises the fencing number alone, on the object as read.
        leases = coordination.list_namespaced_lease(
            ROTA_NAMESPACE, label_selector=naming.gpu_lease_selector(node.node.name))
        for lease in leases.items:
            lease.spec.lease_transitions = (lease.spec.lease_transitions or 0) + 1
            with contextlib.suppress(client.ApiException):
                coordination.replace_namespaced_lease(lease.metadata.name, ROTA_NAMESPACE,
                                                      lease)
                moved += 1
        return moved

    return Injected(await asyncio.to_thread(move) > 0)


async def _engine_restart(rig: Rig, node: NodeRig, rng: random.Random,
                          session: aiohttp.ClientSession) -> Injected:
    """An engine's container restarts while its GPU is switching: the new start must wait
    its turn like any other (it is crashed once the node's GPU Lease says ``switching``,
    or after 2 s)."""
    def switching() -> bool:
        return any(lease.state == naming.LeaseState.SWITCHING
                   for lease in node_gpu_leases(rig.api, node.node.name, timeout_s=5))

    for pause in Backoff(first_s=0.02, max_s=0.1, attempts=25).delays():
        with contextlib.suppress(client.ApiException):
            if await asyncio.to_thread(switching):
                return await _engine_crash(rig, node, rng, session)
        await asyncio.sleep(pause)
    return NOT_INJECTED  # no switch to start into


CATALOGUE: tuple[Fault, ...] = (
    Fault("wake_oom", 3, _sim_fault("wake_fails")),
    Fault("hung_wake", 1, _sim_fault("wake_hangs")),
    Fault("lying_sleep", 2, _sim_fault("sleep_lies")),
    Fault("ignored_sleep", 1, _sim_fault("sleep_ignored")),
    Fault("ignored_wake", 1, _sim_fault("wake_ignored")),
    Fault("engine_crash", 1, _engine_crash),
    Fault("abandoned_sleep", 1, _abandoned_sleep),
    Fault("controller_sigkill", 1, _controller_signal(signal.SIGKILL)),
    Fault("controller_sigterm", 1, _controller_signal(signal.SIGTERM)),
    Fault("second_instance", 1, _second_instance),
    Fault("api_stall", 1, _api_stall),
    Fault("api_reset", 1, _api_reset),
    Fault("lease_moved", 1, _lease_moved),
    Fault("engine_start_during_switch", 1, _engine_restart),
    Fault("twin_then_engine_restart", 1, _twin_then_engine_restart),
    Fault("slow_start_failover", 1, _slow_start_failover),
)
