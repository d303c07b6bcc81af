"""What every HTTP engine adapter shares: state reads, confirmation, timed steps.

vLLM, vLLM-Omni and the generic HTTP adapter differ in how they put an engine to sleep
and wake it, not in how they read it: ``/is_sleeping`` answers ``{"is_sleeping": bool}``,
``/metrics`` carries vLLM's in-flight gauges, ``/health`` answers 2xx, and the probe is the
same OpenAI request. :class:`HttpEngineAdapter` implements those once, plus the two habits
every sleep and wake must have: time each step against one budget, and confirm the
outcome with ``/is_sleeping`` instead of trusting the 200.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from controller.engines.base import EngineEndpoint, StepTiming, Timeouts
from controller.engines.errors import EngineError, EngineLied, EngineProtocolError
from controller.engines.probe import ProbeResult, run_probe
from controller.engines.prom import sum_samples
from controller.engines.transport import Answer, EngineHttp

__all__ = ["IN_FLIGHT_METRICS", "HttpEngineAdapter", "Step"]

log = logging.getLogger(__name__)

IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""vLLM's gauges of requests in model execution batches and waiting to be scheduled."""


class _IsSleeping(BaseModel):
    model_config = ConfigDict(extra="ignore")

    is_sleeping: StrictBool


@dataclass(frozen=True)
class Step:
    """One HTTP call of a sleep or wake sequence."""

    name: str
    path: str
    params: tuple[tuple[str, str], ...] = ()
    json_body: Mapping[str, Any] | None = None


class HttpEngineAdapter:
    """Shared part of the adapters; subclasses add ``sleep`` and ``wake``."""

    is_sleeping_path = "/is_sleeping"
    metrics_path = "/metrics"
    health_path = "/health"

    def __init__(
        self, endpoint: EngineEndpoint, session: aiohttp.ClientSession, timeouts: Timeouts
    ) -> None:
        self._http = EngineHttp(endpoint, session, timeouts)

    @property
    def endpoint(self) -> EngineEndpoint:
        return self._http.endpoint

    @property
    def timeouts(self) -> Timeouts:
        return self._http.timeouts

    async def is_sleeping(self) -> bool:
        answer = await self._http.read("is_sleeping", self.is_sleeping_path, control=True)
        try:
            return _IsSleeping.model_validate(answer.json("is_sleeping")).is_sleeping
        except ValidationError as exc:
            raise EngineProtocolError(
                'is_sleeping: the answer is not {"is_sleeping": true|false}',
                step="is_sleeping", body=answer.body,
            ) from exc

    async def in_flight(self) -> int | None:
        answer = await self._http.read("metrics", self.metrics_path, control=False,
                                       accept=frozenset({404}))
        if answer.status == 404:
            return None
        total = sum_samples(answer.body, IN_FLIGHT_METRICS)
        return None if total is None else max(0, round(total))

    async def health(self) -> bool:
        try:
            await self._http.read("health", self.health_path, control=False)
        except EngineError as exc:
            log.info("engine not healthy", extra=self.endpoint.log_fields() | {
                "reason": exc.reason, "error": str(exc)})
            return False
        return True

    async def probe(self) -> ProbeResult:
        return await run_probe(self._http.session, self.endpoint, self.timeouts)

    # -- for subclasses ----------------------------------------------------------------

    async def _confirm(self, *, sleeping: bool, after: str) -> None:
        """Read ``/is_sleeping`` and raise :class:`EngineLied` unless it says ``sleeping``."""
        state = await self.is_sleeping()
        if state != sleeping:
            said = "asleep" if state else "awake"
            log.error("engine contradicts its own success answer", extra=(
                self.endpoint.log_fields() | {"step": after, "is_sleeping": state}))
            raise EngineLied(
                f"{after} answered success, but /is_sleeping then said the engine is {said}",
                step=after,
            )

    async def _run_step(
        self, step: Step, *, deadline: float, budget_s: float, timings: list[StepTiming]
    ) -> Answer:
        """POST one step with the time left until ``deadline`` (monotonic); record it."""
        began = time.monotonic()
        remaining = deadline - began
        answer = await self._http.request(
            step.name, "POST", step.path, timeout_s=min(remaining, budget_s), control=True,
            params=step.params or None, json_body=step.json_body,
        )
        timings.append(StepTiming(step.name, time.monotonic() - began))
        return answer

    async def _run_steps(
        self, steps: Sequence[Step], *, budget_s: float
    ) -> tuple[float, list[StepTiming], list[Answer]]:
        """Run ``steps`` in order within one budget; (seconds, timings, answers)."""
        began = time.monotonic()
        deadline = began + budget_s
        timings: list[StepTiming] = []
        answers: list[Answer] = []
        for step in steps:
            answers.append(await self._run_step(step, deadline=deadline, budget_s=budget_s,
                                                timings=timings))
        return time.monotonic() - began, timings, answers
