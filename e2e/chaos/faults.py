"""The faults a campaign injects, each as real as this machine allows: engine faults through
the simulator's ``/sim/faults`` (the ones vLLM shows: a wake that runs out of memory, a
hung wake, a sleep that lies or is ignored, a crash, an abandoned sleep that fires later),
process faults by signal (SIGKILL and SIGTERM of a lease controller mid-step, a second
instance of one identity), API faults through the relay (stalls, resets) and by writing
the Lease as another writer would, and engine starts during switches.

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

import aiohttp
from kubernetes import client

from controller.api import naming
from driver.aio import Backoff
from e2e.chaos.rig import NodeRig, Rig
from e2e.objects import ROTA_NAMESPACE, node_gpu_leases
from e2e.scenario import Engine, set_faults

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
                        session: aiohttp.ClientSession) -> Injected:
    """The engine process dies; the node restarts it (restartPolicy Always)."""
    try:
        await set_faults(session, _engine(node, rng), crash_now=True)
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
)
