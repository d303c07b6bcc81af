"""Instruments of the GPU benchmark: every HTTP call timed, every adapter call recorded.

- :class:`HttpTrace` hooks the benchmark's aiohttp session: each request to an engine
  (sleep, ``is_sleeping``, wake, metrics, the probe) with its start, the time its answer's
  headers arrived, its status or error. A handoff's window of the trace is its HTTP
  timeline, the controller's share of a handoff call by call.
- :class:`BenchAdapter` wraps the real engine adapter the ``Switcher`` uses: it delegates
  every call and records it (the sleep and wake outcomes, with the wake's steps), can run
  a hook when a wake starts (the scenarios kill an engine mid-switch that way), and judges
  the probe in the configured mode. ``structure`` accepts any content, as long as the
  stream ends with ``[DONE]`` and carried a usage block: the models of the GPU runs have
  random weights and answer noise. The controller's own structure-only probe mode
  (per-claimant probe settings) replaces this where it exists.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Literal

import aiohttp

from controller.engines.base import (
    EngineAdapter,
    EngineEndpoint,
    SleepOutcome,
    Timeouts,
    WakeOutcome,
)
from controller.engines.probe import ProbeReason, ProbeResult, run_probe

__all__ = ["AdapterCall", "BenchAdapter", "HttpCall", "HttpTrace", "ProbeMode",
           "structure_verdict"]

ProbeMode = Literal["structure", "answer"]


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


def structure_verdict(result: ProbeResult) -> ProbeResult:
    """The probe's result judged on structure only: some content, ``[DONE]``, a usage block.

    The probe reports the first failure in the order stream error, no ``[DONE]``, wrong
    content, no usage: a ``wrong_content`` verdict means the stream was well formed up to
    its content, so only the content's presence and the usage block remain to check."""
    if result.ok or result.reason is not ProbeReason.WRONG_CONTENT:
        return result
    if result.ttft_s is None or not result.content:
        return replace(result, detail="structure probe: no content arrived")
    if result.usage is None:
        return replace(result, reason=ProbeReason.NO_USAGE,
                       detail="structure probe: the stream carried no usage block")
    return replace(result, ok=True, reason=None, detail="structure probe: any content")


class BenchAdapter:
    """Delegates to the engine's real adapter, records every call, judges the probe."""

    def __init__(self, inner: EngineAdapter, *, engine: str, calls: list[AdapterCall],
                 session: aiohttp.ClientSession, timeouts: Timeouts, probe_mode: ProbeMode,
                 probe_max_tokens: int,
                 on_wake: Callable[[], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.inner = inner
        self.engine = engine
        self.calls = calls
        self.session = session
        self.timeouts = timeouts
        self.probe_mode = probe_mode
        self.probe_max_tokens = probe_max_tokens
        self.on_wake = on_wake
        self.clock = clock

    def __getattr__(self, name: str) -> Any:
        # Methods the adapter protocol gains later reach the real adapter unrecorded.
        return getattr(self.inner, name)

    @property
    def endpoint(self) -> EngineEndpoint:
        return self.inner.endpoint

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

    async def sleep(self, level: int) -> SleepOutcome:
        outcome: SleepOutcome = await self._recorded(f"sleep_l{level}", self.inner.sleep(level))
        self.calls[-1].detail["sleep_call_ms"] = round(outcome.sleep_s * 1e3, 3)
        return outcome

    async def wake(self, level: int) -> WakeOutcome:
        if self.on_wake is not None:
            self.on_wake()
        entry_index = len(self.calls)
        outcome: WakeOutcome = await self._recorded(f"wake_l{level}", self.inner.wake(level))
        self.calls[entry_index].detail.update({
            "wake_call_ms": round(outcome.wake_s * 1e3, 3),
            "steps_ms": {s.name: round(s.seconds * 1e3, 3) for s in outcome.steps}})
        return outcome

    async def is_sleeping(self) -> bool:
        state: bool = await self._recorded("is_sleeping", self.inner.is_sleeping())
        return state

    async def in_flight(self) -> int | None:
        busy: int | None = await self._recorded("in_flight", self.inner.in_flight())
        return busy

    async def health(self) -> bool:
        healthy: bool = await self._recorded("health", self.inner.health())
        return healthy

    async def probe(self) -> ProbeResult:
        if self.probe_mode == "answer":
            result: ProbeResult = await self._recorded("probe", self.inner.probe())
        else:
            raw = run_probe(self.session, self.inner.endpoint, self.timeouts,
                            max_tokens=self.probe_max_tokens)
            result = structure_verdict(await self._recorded("probe", raw))
        self.calls[-1].detail.update({"probe_ok": result.ok, "ttft_ms": None if result.ttft_s
                                      is None else round(result.ttft_s * 1e3, 3),
                                      "probe_reason": str(result.reason or "")})
        return result


async def gather_bounded(*calls: Any, timeout_s: float) -> list[Any]:
    """Run ``calls`` concurrently under one bound; exceptions are returned, not raised."""
    async with asyncio.timeout(timeout_s):
        return list(await asyncio.gather(*calls, return_exceptions=True))
