"""Instruments of the GPU benchmark: every HTTP call timed, every adapter call recorded.

- :class:`HttpTrace` hooks the benchmark's aiohttp session: each request to an engine
  (sleep, ``is_sleeping``, wake, metrics, the probe) with its start, the time its answer's
  headers arrived, its status or error. A handoff's window of the trace is its HTTP
  timeline, the controller's share of a handoff call by call.
- :class:`BenchAdapter` wraps the real engine adapter the ``Switcher`` uses: it delegates
  every call and records it (the sleep and wake outcomes, with the wake's steps, and the
  probe's verdict and mode), and can run a hook when a wake starts (the scenarios kill an
  engine mid-switch that way). The probe is the controller's own, as the claim's
  ``probe`` section configures it (the GPU runs use ``mode: structure``: their models have
  random weights and answer noise).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import aiohttp

from controller.lease.engines.base import (
    EngineAdapter,
    EngineEndpoint,
    SleepOutcome,
    SleepState,
    UnfinishedWake,
    WakeOutcome,
)
from controller.lease.engines.probe import ProbeResult

__all__ = ["AdapterCall", "BenchAdapter", "HttpCall", "HttpTrace"]


@dataclass(frozen=True)
class HttpCall:
    """One HTTP request of the benchmark's session (monotonic seconds)."""

    method: str
    path: str
    port: int | None
    started: float
    answered: float | None
    status: int | None
    error: str | None

    def as_dict(self, origin: float) -> dict[str, Any]:
        return {"method": self.method, "path": self.path, "port": self.port,
                "start_ms": round((self.started - origin) * 1e3, 3),
                "ms": None if self.answered is None else round(
                    (self.answered - self.started) * 1e3, 3),
                "status": self.status, "error": self.error}


class HttpTrace:
    """Records every request of the sessions it is attached to."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.calls: list[HttpCall] = []
        self.max_calls = 200_000

    def config(self) -> aiohttp.TraceConfig:
        trace = aiohttp.TraceConfig()
        trace.on_request_start.append(self._start)
        trace.on_request_end.append(self._end)
        trace.on_request_exception.append(self._exception)
        return trace

    async def _start(self, _session: aiohttp.ClientSession, ctx: SimpleNamespace,
                     params: aiohttp.TraceRequestStartParams) -> None:
        ctx.rota_started = self.clock()

    def _add(self, ctx: SimpleNamespace, method: str, url: Any, status: int | None,
             error: str | None) -> None:
        if len(self.calls) >= self.max_calls:
            return
        started = getattr(ctx, "rota_started", self.clock())
        self.calls.append(HttpCall(method, url.path, url.port, started, self.clock(),
                                   status, error))

    async def _end(self, _session: aiohttp.ClientSession, ctx: SimpleNamespace,
                   params: aiohttp.TraceRequestEndParams) -> None:
        self._add(ctx, params.method, params.url, params.response.status, None)

    async def _exception(self, _session: aiohttp.ClientSession, ctx: SimpleNamespace,
                         params: aiohttp.TraceRequestExceptionParams) -> None:
        self._add(ctx, params.method, params.url, None, type(params.exception).__name__)

    def window(self, start: float, end: float) -> list[HttpCall]:
        """The calls that started in [start, end]."""
        return [c for c in self.calls if start <= c.started <= end]


@dataclass
class AdapterCall:
    """One call the switch made on an engine, as the wrapper saw it."""

    engine: str
    name: str
    started: float
    ended: float = 0.0
    ok: bool = False
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def as_dict(self, origin: float) -> dict[str, Any]:
        return {"engine": self.engine, "call": self.name,
                "start_ms": round((self.started - origin) * 1e3, 3),
                "ms": round((self.ended - self.started) * 1e3, 3), "ok": self.ok,
                "error": self.error, **self.detail}


class BenchAdapter:
    """Delegates to the engine's real adapter, records every call, judges the probe."""

    def __init__(self, inner: EngineAdapter, *, engine: str, calls: list[AdapterCall],
                 on_wake: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.engine = engine
        self.calls = calls
        self.on_wake = on_wake
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        # Methods the adapter protocol gains later reach the real adapter unrecorded.
        return getattr(self.inner, name)

    @property
    def endpoint(self) -> EngineEndpoint:
        return self.inner.endpoint

    def fenced(self, fences: Mapping[str, int]) -> BenchAdapter:
        """The fenced adapter the switch calls, still recorded (``__getattr__`` would hand
        out the inner adapter's copy, and every call after the fencing check would go
        unrecorded, the wake hooks unrun)."""
        return BenchAdapter(self.inner.fenced(fences), engine=self.engine, calls=self.calls,
                            on_wake=self.on_wake, clock=self.clock)

    async def _recorded(self, name: str, call: Any) -> Any:
        entry = AdapterCall(self.engine, name, self.clock())
        self.calls.append(entry)
        try:
            result = await call
        except BaseException as exc:
            entry.error = f"{type(exc).__name__}: {exc}"[:300]
            entry.detail["reason"] = getattr(exc, "reason", None)
            raise
        finally:
            entry.ended = self.clock()
        entry.ok = True
        return result

    async def sleep(self, level: int, *, confirm: bool = True, keep: bool = False
                    ) -> SleepOutcome:
        outcome: SleepOutcome = await self._recorded(
            f"sleep_l{level}{'_keep' if keep else ''}",
            self.inner.sleep(level, confirm=confirm, keep=keep))
        self.calls[-1].detail["sleep_call_ms"] = round(outcome.sleep_s * 1e3, 3)
        return outcome

    async def wake(self, level: int, *, confirm: bool = True) -> WakeOutcome:
        if self.on_wake is not None:
            self.on_wake()
        entry_index = len(self.calls)
        outcome: WakeOutcome = await self._recorded(
            f"wake_l{level}", self.inner.wake(level, confirm=confirm))
        self.calls[entry_index].detail.update({
            "wake_call_ms": round(outcome.wake_s * 1e3, 3),
            "steps_ms": {s.name: round(s.seconds * 1e3, 3) for s in outcome.steps}})
        return outcome

    async def confirm_asleep(self, level: int) -> None:
        await self._recorded("confirm_asleep", self.inner.confirm_asleep(level))

    async def confirm_awake(self) -> None:
        await self._recorded("confirm_awake", self.inner.confirm_awake())

    async def is_sleeping(self) -> bool:
        state: bool = await self._recorded("is_sleeping", self.inner.is_sleeping())
        return state

    async def in_flight(self) -> int | None:
        busy: int | None = await self._recorded("in_flight", self.inner.in_flight())
        return busy

    async def health(self) -> bool:
        healthy: bool = await self._recorded("health", self.inner.health())
        return healthy

    async def finish_wake(self, unfinished: UnfinishedWake) -> WakeOutcome:
        entry_index = len(self.calls)
        outcome: WakeOutcome = await self._recorded(
            f"finish_wake_l{unfinished.level}", self.inner.finish_wake(unfinished))
        self.calls[entry_index].detail.update({
            "from_step": unfinished.next_step, "wake_call_ms": round(outcome.wake_s * 1e3, 3),
            "steps_ms": {s.name: round(s.seconds * 1e3, 3) for s in outcome.steps}})
        return outcome

    async def sleep_state(self, unfinished: UnfinishedWake | None = None) -> SleepState:
        entry_index = len(self.calls)
        state: SleepState = await self._recorded("sleep_state",
                                                 self.inner.sleep_state(unfinished))
        self.calls[entry_index].detail.update({"kind": str(state.kind),
                                               "detail": state.detail[:200]})
        return state

    async def probe(self) -> ProbeResult:
        entry_index = len(self.calls)
        result: ProbeResult = await self._recorded("probe", self.inner.probe())
        self.calls[entry_index].detail.update({
            "probe_ok": result.ok, "probe_mode": str(result.mode),
            "ttft_ms": None if result.ttft_s is None else round(result.ttft_s * 1e3, 3),
            "probe_reason": str(result.reason or "")})
        return result


async def gather_bounded(*calls: Any, timeout_s: float) -> list[Any]:
    """Run ``calls`` concurrently under one bound; exceptions are returned, not raised."""
    async with asyncio.timeout(timeout_s):
        return list(await asyncio.gather(*calls, return_exceptions=True))
