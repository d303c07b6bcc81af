"""The coalescing window: before a switch closes the holder's admission, the holder may
finish its in-flight work, bounded by the window."""

from __future__ import annotations

import asyncio
from typing import Any

from controller.claimants import Claimant
from controller.lease.gpu import GpuWorker, Policy
from rota.api.engine_config import parse_engine_config


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Engine:
    """Reports a queue of in-flight counts, one per call, advancing the clock each time."""

    def __init__(self, counts: list[int], clock: _Clock) -> None:
        self.counts = counts
        self.clock = clock
        self.calls = 0

    async def in_flight(self) -> int:
        self.calls += 1
        self.clock.now += 0.1
        return self.counts.pop(0) if self.counts else 0


def _holder() -> Claimant:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                                  "model": "m", "awakeMemory": "8Gi"})
    return Claimant(claim_uid="u", namespace="ns", claim_name="c", node="n", device="gpu-0",
                    share_id="s", config=config, model="m", port=8000, sleep_level=1,
                    resident_bytes=1 << 30, pod_name="p", pod_uid="pu", pod_ip="127.0.0.2",
                    pod_ready=True, pod_deleting=False)


def _worker(engine: _Engine, clock: _Clock, window: float) -> GpuWorker:
    unused: Any = None
    return GpuWorker(gpu="gpu-0", lease_port=unused, switcher=unused,
                     claimants=unused, engine=lambda c: engine,  # type: ignore[arg-type,return-value]
                     policy=Policy(coalesce_window_s=window), clock=clock)


async def test_the_holder_finishes_its_work_before_the_switch() -> None:
    clock = _Clock()
    engine = _Engine([3, 2, 1, 0], clock)
    stopping = await _worker(engine, clock, window=5.0)._coalesce(_holder(), asyncio.Event())
    assert stopping is False
    assert engine.calls == 4, "it waited until the holder reported no work"


async def test_the_window_bounds_the_wait() -> None:
    clock = _Clock()
    engine = _Engine([5] * 100, clock)
    await _worker(engine, clock, window=0.35)._coalesce(_holder(), asyncio.Event())
    assert engine.calls == 4
    assert clock.now <= 0.45


async def test_a_stopping_controller_ends_the_wait() -> None:
    clock = _Clock()
    stop = asyncio.Event()
    stop.set()
    assert await _worker(_Engine([5] * 10, clock), clock, window=5.0)._coalesce(
        _holder(), stop) is True
