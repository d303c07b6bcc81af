"""What every HTTP engine adapter shares: state reads, confirmation, timed steps.

vLLM, vLLM-Omni and the generic HTTP adapter differ in how they put an engine to sleep
and wake it, not in how they read it: ``/is_sleeping`` answers ``{"is_sleeping": bool}``,
``/metrics`` carries vLLM's in-flight and sleep gauges, ``/health`` answers 2xx (503 once
the engine core is dead), and the probe is the same OpenAI request.
:class:`HttpEngineAdapter` implements those once, plus the habits every sleep and wake
must have:

- time each step against one budget;
- confirm the outcome with ``/is_sleeping`` instead of trusting the 200, and with
  ``vllm:engine_sleep_state`` as a second witness where the engine exports it;
- never abandon a sleep silently: a sleep call that does not answer in time (or whose
  connection broke after it was sent) raises
  :class:`~controller.lease.engines.errors.EngineStateUnknown`, because vLLM keeps such a
  sleep registered and carries it out when the engine next goes idle;
- a wake that stops partway raises with :attr:`EngineError.unfinished` set, so that the
  caller can finish it (:meth:`HttpEngineAdapter.finish_wake`): vLLM cannot put a
  half-woken engine back to sleep.

**Drain needs stats logging.** The in-flight gauges exist only when vLLM logs stats
(``--disable-log-stats`` removes them, and ``vllm:engine_sleep_state`` with them); they are
what the engine core reported at its last step, so requests held while it sleeps or idles
paused do not show.
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import aiohttp
from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from controller.lease.engines.base import (
    EngineEndpoint,
    SleepState,
    SleepStateKind,
    StepTiming,
    Timeouts,
    UnfinishedWake,
    WakeOutcome,
)
from controller.lease.engines.errors import (
    EngineDead,
    EngineError,
    EngineLied,
    EngineProtocolError,
    EngineStateUnknown,
    EngineTimeout,
    EngineUnreachable,
    EngineUnsupported,
)
from controller.lease.engines.probe import ProbeMode, ProbeReason, ProbeResult, run_probe
from controller.lease.engines.prom import label_values_at_one, sum_samples
from controller.lease.engines.transport import Answer, EngineHttp
from rota.api.engine_config import ProbeConfig
from rota.kit.aio import both

__all__ = [
    "ALL_TAGS",
    "IN_FLIGHT_METRICS",
    "SLEEP_STATE_LEVELS",
    "SLEEP_STATE_METRIC",
    "HttpEngineAdapter",
    "Step",
]

log = logging.getLogger(__name__)

IN_FLIGHT_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
"""vLLM's gauges of requests in model execution batches and waiting to be scheduled."""
SLEEP_STATE_METRIC = "vllm:engine_sleep_state"
_NOT_SERVED = frozenset({301, 302, 303, 307, 308, 401, 403, 404, 405})
"""Answers of a filtered metrics read that send the adapter to the whole page."""
SLEEP_STATE_LEVELS: Mapping[str, int] = {"awake": 0, "weights_offloaded": 1, "discard_all": 2}
"""``sleep_state`` label values of :data:`SLEEP_STATE_METRIC`, and the level each means."""
ALL_TAGS = ("weights", "kv_cache")


class _IsSleeping(BaseModel):
    model_config = ConfigDict(extra="ignore")

    is_sleeping: StrictBool


@dataclass(frozen=True)
class Step:
    """One HTTP call of a sleep or wake sequence.

    Attributes:
        wakes: the memory tags this step brings back (what is no longer asleep once it
            completed), for reporting an unfinished wake.
    """

    name: str
    path: str
    params: tuple[tuple[str, str], ...] = ()
    json_body: Mapping[str, Any] | None = None
    wakes: tuple[str, ...] = ()


class HttpEngineAdapter:
    """Shared part of the adapters; subclasses add ``sleep`` and the wake steps."""

    sleep_step = "sleep"
    """The name of the sleep call in errors and logs."""
    wake_step = "wake"
    """The name of the wake (its last call) in errors and logs."""
    is_sleeping_path = "/is_sleeping"
    metrics_path = "/metrics"
    filtered_metrics_path: str | None = "/metrics/"
    """Where the engine serves only the metric families named by ``name[]`` parameters
    (prometheus_client's own exposition app), or None. vLLM answers ``/metrics`` through
    prometheus-fastapi-instrumentator, which ignores ``name[]`` and renders every family
    (6-13 ms on an H200 host, on a switch's path twice); the Mount behind it, reached as
    ``/metrics/``, is prometheus_client's app, which collects only the families asked
    for. An engine that does not serve it (any non-2xx) is read at ``metrics_path``."""
    health_path = "/health"
    reads_sleep_gauge = True
    """Whether ``vllm:engine_sleep_state`` speaks for this engine's sleeps (vLLM's own
    sleep and wake record it; vLLM-Omni's stage calls do not)."""

    def __init__(
        self, endpoint: EngineEndpoint, session: aiohttp.ClientSession, timeouts: Timeouts,
        *, probe: ProbeConfig | None = None,
    ) -> None:
        self._http = EngineHttp(endpoint, session, timeouts)
        self.probe_config = probe if probe is not None else ProbeConfig()

    @property
    def endpoint(self) -> EngineEndpoint:
        return self._http.endpoint

    def fenced(self, fences: Mapping[str, int]) -> Self:
        """A copy of this adapter (subclass state included) whose control calls carry
        ``fences``; this one is left as it was."""
        bound = copy.copy(self)
        bound._http = EngineHttp(self.endpoint.fenced(fences), self._http.session,
                                 self._http.timeouts)
        return bound

    @property
    def timeouts(self) -> Timeouts:
        return self._http.timeouts

    # -- reads -------------------------------------------------------------------------

    async def is_sleeping(self) -> bool:
        answer = await self._http.read("is_sleeping", self.is_sleeping_path, control=True)
        try:
            return _IsSleeping.model_validate(answer.json("is_sleeping")).is_sleeping
        except ValidationError as exc:
            raise EngineProtocolError(
                'is_sleeping: the answer is not {"is_sleeping": true|false}',
                step="is_sleeping", body=answer.body,
            ) from exc

    async def _metrics(self, names: Sequence[str]) -> str | None:
        """The exposition text with (at least) the families ``names``; None when the
        engine serves no metrics."""
        if self.filtered_metrics_path is not None:
            answer = await self._http.read(
                "metrics", self.filtered_metrics_path, control=True,
                params=[("name[]", name) for name in names], accept=_NOT_SERVED)
            if 200 <= answer.status < 300:
                return answer.body
        answer = await self._http.read("metrics", self.metrics_path, control=True,
                                       accept=frozenset({404}))
        return None if answer.status == 404 else answer.body

    async def in_flight(self) -> int | None:
        text = await self._metrics(IN_FLIGHT_METRICS)
        total = None if text is None else sum_samples(text, IN_FLIGHT_METRICS)
        return None if total is None else max(0, round(total))

    async def sleep_gauge(self) -> str | None:
        """The ``sleep_state`` that ``vllm:engine_sleep_state`` reports (the deepest one when
        several engine cores report), or None when the engine has no such gauge."""
        if not self.reads_sleep_gauge:
            return None
        text = await self._metrics((SLEEP_STATE_METRIC,))
        states = None if text is None else label_values_at_one(
            text, SLEEP_STATE_METRIC, "sleep_state")
        if not states:
            return None
        known = [s for s in states if s in SLEEP_STATE_LEVELS]
        return max(known, key=SLEEP_STATE_LEVELS.__getitem__) if known else None

    async def health(self) -> bool:
        try:
            await self._http.read("health", self.health_path, control=False)
        except EngineError as exc:
            log.info("engine not healthy", extra=self.endpoint.log_fields() | {
                "reason": exc.reason, "error": str(exc)})
            return False
        return True

    async def probe(self) -> ProbeResult:
        """The correctness request, after :meth:`preflight` (the claim's first probe finds
        an engine rota cannot drive, before any switch depends on it)."""
        began = time.monotonic()
        try:
            await self.preflight()
        except EngineUnsupported as exc:
            log.error("engine not supported", extra=self.endpoint.log_fields() | {
                "reason": exc.reason, "error": str(exc)})
            return ProbeResult(ok=False, mode=ProbeMode(self.probe_config.mode),
                               reason=ProbeReason.UNSUPPORTED_ENGINE, content="", ttft_s=None,
                               total_s=time.monotonic() - began, usage=None, detail=str(exc))
        except EngineError as exc:
            # unreadable now: the probe below says what is wrong; read again next time
            log.warning("engine release not read", extra=self.endpoint.log_fields() | {
                "reason": exc.reason, "error": str(exc)})
        return await run_probe(self._http.session, self.endpoint, self.timeouts,
                               config=self.probe_config)

    async def preflight(self) -> None:
        """Check that this engine is one this adapter can drive (subclasses: its release
        and its routes); raises :class:`EngineUnsupported` when not."""

    async def sleep_state(self, unfinished: UnfinishedWake | None = None) -> SleepState:
        """See :meth:`~controller.lease.engines.base.EngineAdapter.sleep_state`."""
        try:
            health = await self._http.read("health", self.health_path, control=False,
                                           accept=frozenset({503}))
            if health.status == 503:
                return SleepState(SleepStateKind.DEAD,
                                  detail="/health answered 503: the engine core is dead")
            sleeping = await self.is_sleeping()
            gauge = await self.sleep_gauge()
        except EngineDead as exc:
            return SleepState(SleepStateKind.DEAD, detail=str(exc))
        except EngineError as exc:
            return SleepState(SleepStateKind.UNKNOWN, detail=f"cannot read it: {exc}")
        level = SLEEP_STATE_LEVELS.get(gauge) if gauge is not None else None
        state = self._judge(sleeping, gauge, level, unfinished)
        log.debug("engine sleep state", extra=self.endpoint.log_fields() | {
            "state": state.kind.value, "is_sleeping": sleeping, "gauge": gauge})
        return state

    @staticmethod
    def _judge(sleeping: bool, gauge: str | None, level: int | None,
               unfinished: UnfinishedWake | None) -> SleepState:
        seen: dict[str, Any] = {"is_sleeping": sleeping, "gauge": gauge}
        if not sleeping:
            if level:
                return SleepState(SleepStateKind.UNKNOWN, level=level, detail=(
                    f"/is_sleeping says awake but {SLEEP_STATE_METRIC} says {gauge}"), **seen)
            return SleepState(SleepStateKind.AWAKE, **seen)
        if unfinished is not None:
            return SleepState(SleepStateKind.PARTLY_ASLEEP, level=unfinished.level,
                              tags_asleep=unfinished.tags_asleep,
                              detail=f"a wake stopped before {unfinished.next_step}", **seen)
        if level:
            return SleepState(SleepStateKind.ASLEEP, level=level, **seen)
        if gauge is None:
            return SleepState(SleepStateKind.ASLEEP, detail=(
                f"unconfirmed: the engine exports no {SLEEP_STATE_METRIC} (stats logging "
                "off?)"), **seen)
        return SleepState(SleepStateKind.UNKNOWN, detail=(
            "/is_sleeping says asleep but no sleep completed since the last wake call: the "
            "scheduler is paused (a sleep still draining, which may fire later) or a wake "
            "stopped halfway"), **seen)

    async def can_keep(self, level: int) -> bool:
        """Whether this engine serves a sleep that keeps requests in flight (the generic
        adapter: at level 1, where the claim says it keeps them; see each adapter)."""
        return False

    async def confirm_asleep(self, level: int) -> None:
        await self._confirm(sleeping=True, after=self.sleep_step, level=level)

    async def confirm_awake(self) -> None:
        await self._confirm(sleeping=False, after=self.wake_step)

    # -- for subclasses ----------------------------------------------------------------

    async def _confirm(self, *, sleeping: bool, after: str, level: int | None = None) -> None:
        """Raise :class:`EngineLied` unless ``/is_sleeping`` says ``sleeping`` and (where
        exported) ``vllm:engine_sleep_state`` agrees (``level`` after a sleep). Both are
        read at once: vLLM renders its metrics in milliseconds, which, one after the other,
        were most of a switch's own time."""
        state, gauge = await both(self.is_sleeping(), self.sleep_gauge())
        if state != sleeping:
            said = "asleep" if state else "awake"
            log.error("engine contradicts its own success answer", extra=(
                self.endpoint.log_fields() | {"step": after, "is_sleeping": state}))
            raise EngineLied(
                f"{after} answered success, but /is_sleeping then said the engine is {said}",
                step=after,
            )
        expected = level if sleeping else 0
        if gauge is not None and expected is not None \
                and SLEEP_STATE_LEVELS.get(gauge) != expected:
            log.error("engine's sleep gauge contradicts its success answer", extra=(
                self.endpoint.log_fields() | {"step": after, "gauge": gauge}))
            raise EngineLied(f"{after} answered success, but {SLEEP_STATE_METRIC} then said "
                             f"{gauge}", step=after)

    async def _sleep_call(self, step: Step, *, budget_s: float) -> tuple[float, Answer]:
        """POST a sleep call; (seconds, answer). A sleep whose outcome is unknown (no answer
        in time, a connection broken after sending) raises :class:`EngineStateUnknown`."""
        began = time.monotonic()
        try:
            answer = await self._http.request(
                step.name, "POST", step.path, timeout_s=budget_s, control=True,
                params=step.params or None, json_body=step.json_body)
        except (EngineTimeout, EngineUnreachable) as exc:
            if isinstance(exc, EngineUnreachable) and not exc.request_sent:
                raise
            log.error("sleep outcome unknown: it may still take effect later", extra=(
                self.endpoint.log_fields() | {"step": step.name, "error": str(exc)}))
            raise EngineStateUnknown(
                f"{step.name}: {exc}; the engine may still fall asleep later (vLLM carries "
                "out a pending sleep when it next goes idle, even after a wake): treat it "
                "as possibly awake and possibly about to sleep until /is_sleeping and the "
                "device agree", step=step.name) from exc
        return time.monotonic() - began, answer

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
        self._check_answer(step, answer)
        timings.append(StepTiming(step.name, time.monotonic() - began))
        return answer

    def _check_answer(self, step: Step, answer: Answer) -> None:
        """Raise when a 2xx answer says the step failed (subclasses know their bodies)."""

    async def _run_wake(
        self, level: int, steps: Sequence[Step], *, start: int = 0, budget_s: float
    ) -> tuple[float, list[StepTiming], list[Answer]]:
        """Run ``steps[start:]`` in order within one budget; (seconds, timings, answers).

        A step that fails raises with ``unfinished`` set; one that does not answer in time
        (it may still complete inside the engine) raises :class:`EngineStateUnknown`.
        """
        began = time.monotonic()
        deadline = began + budget_s
        timings: list[StepTiming] = []
        answers: list[Answer] = []
        for index in range(start, len(steps)):
            step = steps[index]
            try:
                answers.append(await self._run_step(step, deadline=deadline,
                                                    budget_s=budget_s, timings=timings))
            except EngineError as exc:
                woken = {tag for done in steps[:index] for tag in done.wakes}
                unfinished = UnfinishedWake(
                    level=level, next_step=step.name,
                    tags_asleep=tuple(t for t in ALL_TAGS if t not in woken))
                if isinstance(exc, EngineTimeout) or (
                        isinstance(exc, EngineUnreachable) and exc.request_sent):
                    unknown = EngineStateUnknown(
                        f"{step.name}: {exc}; the step may still complete inside the engine",
                        step=step.name)
                    unknown.unfinished = unfinished
                    raise unknown from exc
                if not isinstance(exc, EngineDead):
                    exc.unfinished = unfinished
                log.warning("wake stopped partway", extra=self.endpoint.log_fields() | {
                    "step": step.name, "reason": exc.reason,
                    "tags_asleep": list(unfinished.tags_asleep)})
                raise
        return time.monotonic() - began, timings, answers

    def _wake_steps(self, level: int) -> Sequence[Step]:
        raise NotImplementedError

    async def _after_wake(self, level: int, timings: list[StepTiming]) -> None:
        """What a wake does once its steps completed, before its confirmation (vLLM: resume
        an engine left paused); appends its calls to ``timings``."""

    async def wake(self, level: int, *, confirm: bool = True) -> WakeOutcome:
        return await self._wake_from(level, 0, confirm=confirm)

    async def finish_wake(self, unfinished: UnfinishedWake) -> WakeOutcome:
        steps = self._wake_steps(unfinished.level)
        names = [s.name for s in steps]
        if unfinished.next_step not in names:
            raise ValueError(f"no wake step {unfinished.next_step!r} at level "
                             f"{unfinished.level}; the steps are {names}")
        log.info("finishing a wake that stopped partway", extra=self.endpoint.log_fields() | {
            "sleep_level": unfinished.level, "from_step": unfinished.next_step})
        return await self._wake_from(unfinished.level, names.index(unfinished.next_step))

    async def _wake_from(self, level: int, start: int, *, confirm: bool = True
                         ) -> WakeOutcome:
        steps = self._wake_steps(level)
        wake_s, timings, _ = await self._run_wake(level, steps, start=start,
                                                  budget_s=self.timeouts.wake_s(level))
        began = time.monotonic()
        await self._after_wake(level, timings)
        wake_s += time.monotonic() - began
        if confirm:
            await self.confirm_awake()
        log.info("engine awake", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(wake_s, 6), "confirmed": confirm,
            "steps": {t.name: round(t.seconds, 6) for t in timings}})
        return WakeOutcome(level=level, wake_s=wake_s, steps=tuple(timings))
