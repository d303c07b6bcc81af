"""A controller instance paused between its fencing check and its engine call: the newer
instance has acted meanwhile, and the stale wake is refused by the engine guard (the
review's hypothesis, reproduced).

Two real engine simulators, each behind its own engine guard with its own control token,
on one in-memory GPU Lease. Instance B is the controller's own GPU worker
(:func:`e2e.harness.gang_node.node_of`); instance A is a :class:`Switcher` on the same Lease whose
adapters stop at the wake call until the test lets them go: A passed
``Switcher.fenced_engine`` and is paused past its election Lease. B takes over, reconciles
(and serves); then A's wake goes out. On the old code it lands (no one checks fences at
the engine) and two engines are awake; now the engine guard refuses it (409).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from controller.claimants import Claimant
from controller.credentials import Credential
from controller.guard.proxy import make_app
from controller.guard.settings import GuardSettings
from controller.lease.engines.base import EngineAdapter, EngineEndpoint, Timeouts, WakeOutcome
from controller.lease.engines.errors import EngineError
from controller.lease.engines.vllm import VllmAdapter
from controller.lease.metrics import SwitchMetrics
from controller.lease.settings import StepTimeouts
from controller.lease.switch import Fenced, Limits, Ports, Switcher, SwitchResult
from e2e.harness.gang_node import TOLERANCE, Engine, GangNode, gang_claimant, node_of
from e2e.harness.ports import MemoryLeasePort
from rota.api import naming
from rota.api.gpu_lease import GpuLease
from tests.controller.conftest import EngineSimFactory

pytestmark = pytest.mark.controller

GIB = 2**30
GPU = "gpu-0"
DEADLINE_S = 30.0
ENGINE_TIMEOUTS = Timeouts(sleep_s=10.0, wake_level1_s=10.0, wake_level2_s=10.0,
                           probe_total_s=10.0)


@dataclass
class Pause:
    """Where instance A stops: after its fencing check, before its wake call."""

    reached: asyncio.Event = field(default_factory=asyncio.Event)
    go: asyncio.Event = field(default_factory=asyncio.Event)


class PausedVllmAdapter(VllmAdapter):
    """A vLLM adapter whose first wake waits for :attr:`Pause.go` (a controller process
    stopped, by the scheduler or a debugger, before it sends the call)."""

    pause: Pause

    async def wake(self, level: int, *, confirm: bool = True) -> WakeOutcome:
        if not self.pause.go.is_set():
            self.pause.reached.set()
            await self.pause.go.wait()
        return await super().wake(level, confirm=confirm)


@dataclass
class TwoInstances:
    node: GangNode
    """Instance B: the controller's workers, not running until the test starts them."""
    old: Switcher
    """Instance A, whose wake is paused."""
    pause: Pause
    a: Engine
    b: Engine

    def awake(self) -> list[str]:
        return [e.claimant.claim_name for e in (self.a, self.b) if e.awake_on(GPU)]


async def _guard(tmp_path: Path, name: str, upstream: str, token: str) -> TestServer:
    """An engine guard in front of ``upstream`` that takes ``token`` for control calls."""
    token_file = tmp_path / f"token-{name}"
    token_file.write_text(token + "\n")
    values: dict[str, Any] = {"upstream": upstream}
    if "control_token_file" in GuardSettings.model_fields:
        values["control_token_file"] = token_file  # guards before per-claim tokens
    control = Credential(token_file, recheck_s=0.0)
    await control.load()
    server = TestServer(make_app(GuardSettings.model_validate(values), control=control,
                                 api_key=None), host="127.0.0.1", port=0)
    await server.start_server()
    return server


@pytest.fixture
async def instances(tmp_path: Path, engine_sim_factory: EngineSimFactory,
                    engine_session: aiohttp.ClientSession) -> AsyncIterator[TwoInstances]:
    engines: list[Engine] = []
    guards: list[TestServer] = []
    base_urls: dict[str, str] = {}
    tokens: dict[str, str] = {}
    for name in ("a", "b"):
        sim = await engine_sim_factory(model=f"m-{name}", awake_memory_bytes=20 * GIB,
                                       resident_memory_bytes=GIB, weights_bytes=10 * GIB)
        engine = Engine(sim, gang_claimant(sim, name, (GPU,)))
        token = f"control-token-of-{name}"
        guard = await _guard(tmp_path, name, sim.base_url, token)
        guards.append(guard)
        engines.append(engine)
        base_urls[engine.claimant.claim_uid] = str(guard.make_url("")).rstrip("/")
        tokens[engine.claimant.claim_uid] = token
    pause = Pause()

    def endpoint(claimant: Claimant) -> EngineEndpoint:
        return EngineEndpoint(base_url=base_urls[claimant.claim_uid], model=claimant.model,
                              claim=claimant.ref, token=tokens[claimant.claim_uid])

    def adapter(claimant: Claimant) -> EngineAdapter:
        return VllmAdapter(endpoint(claimant), engine_session, ENGINE_TIMEOUTS)

    def paused(claimant: Claimant) -> EngineAdapter:
        stopping = PausedVllmAdapter(endpoint(claimant), engine_session, ENGINE_TIMEOUTS)
        stopping.pause = pause
        return stopping

    leases = {GPU: MemoryLeasePort(GpuLease(name=naming.gpu_lease_name("node-a", GPU),
                                            node="node-a", device=GPU))}
    node = node_of(engines, engine_session, leases)
    node.adapter = adapter
    for worker in node.workers.values():  # instance B speaks to the engines' guards
        worker.engine = adapter
        worker.switcher.ports.engine = adapter
    old = Switcher(ports=Ports(lease=leases[GPU], device=node.device, engine=paused,
                               guard=lambda: None, observer=SwitchMetrics()),
                   limits=Limits(tolerance_bytes=TOLERANCE, unknown_limit_bytes=TOLERANCE,
                                 timeouts=StepTimeouts(), restore_wait_s=0.5),
                   identity="controller-old")
    a, b = engines
    await adapter(b.claimant).sleep(1)  # A awake and holding, B asleep
    node.hold(a)
    try:
        yield TwoInstances(node, old, pause, a, b)
    finally:
        pause.go.set()
        await node.close()
        for guard in guards:
            await guard.close()


async def _takeover(two: TwoInstances) -> None:
    """Instance B leads the node: it reconciles, then serves A's model (its activation is
    answered after the reconciliation its workers start with)."""
    two.node.start()
    async with asyncio.timeout(DEADLINE_S):
        served = await two.node.activate(two.a)
    assert served.ok, served.message


async def _stale(call: asyncio.Task[Any]) -> BaseException | Any:
    async with asyncio.timeout(DEADLINE_S):
        try:
            return await call
        except (EngineError, Fenced) as exc:
            return exc


async def test_a_stale_wake_after_a_takeover_is_refused(instances: TwoInstances) -> None:
    """A passed its fencing check for a wake of B's engine (the Lease says A's engine is
    awake; nothing is unfinished), then paused. Instance B takes over: it only reads the
    engines, which is all the engine guard of B's engine hears from it."""
    two = instances
    lease = await two.old.ports.lease.read()
    engine = await two.old.fenced_engine(two.b.claimant, lease.fence, {})
    await _takeover(two)
    assert two.node.lease(GPU).fence > lease.fence
    assert two.awake() == ["a"]

    two.pause.go.set()
    outcome = await _stale(asyncio.ensure_future(engine.wake(1)))

    # Old code: the wake lands; ['a', 'b'] are awake on one GPU.
    assert two.awake() == ["a"], f"two engines awake after the stale wake ({outcome!r})"
    assert isinstance(outcome, EngineError), outcome
    assert "409" in str(outcome)
    assert "stale fence" in str(outcome)


async def test_a_switch_paused_before_its_wake_lands_nothing_after_a_takeover(
        instances: TwoInstances) -> None:
    """A switches from A's engine to B's: it drains and puts A's engine to sleep, checks
    its fence for the wake of B's, and pauses. Instance B takes over, reconciles the
    unfinished switch and serves A's model again; A's wake of B's engine then goes out."""
    two = instances
    ca, cb = two.a.claimant, two.b.claimant
    switch = asyncio.ensure_future(two.old.switch(
        await two.old.ports.lease.read(), holder=ca, target=cb, claimants=[ca, cb]))
    async with asyncio.timeout(DEADLINE_S):
        await asyncio.wait([switch, asyncio.ensure_future(two.pause.reached.wait())],
                           return_when=asyncio.FIRST_COMPLETED)
    assert two.pause.reached.is_set(), switch.result()
    assert two.awake() == []

    await _takeover(two)
    assert two.awake() == ["a"]
    two.pause.go.set()
    outcome = await _stale(switch)

    # Old code: A's wake lands after B woke A's engine: ['a', 'b'] awake on one GPU.
    assert two.awake() == ["a"], f"two engines awake after the stale wake ({outcome!r})"
    assert not (isinstance(outcome, SwitchResult) and outcome.ok), outcome
    assert two.node.lease(GPU).holder == ca.ref
    assert two.b.sim.engine.state.is_sleeping
