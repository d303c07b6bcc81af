"""The adapter for vLLM-Omni, whose stages sleep and wake through stage-aware calls, as
vLLM-Omni 0.26 (and 0.30) behave.

- Sleep: ``POST /v1/omni/sleep`` ``{"stage_ids": [...], "level": 1}``; wake:
  ``POST /v1/omni/wakeup`` ``{"stage_ids": [...]}``. Both answer ``{"status":
  "SUCCESS"|"SKIPPED", "acks": [...]}``, one ACK per stage (rank 0) with the bytes it
  freed; ``metadata.total_freed_gib`` and ``rank_residual_gib`` are strings (``"12.34"``).
  Any ACK with status ``ERROR`` fails the call
  (:class:`~controller.lease.engines.errors.EngineRejected`, reason ``ack_error``, or
  ``gpu_oom`` when its message says the device ran out of memory).
- **Level 1 only.** A wakeup after a level-2 sleep is not implemented (501) and leaves the
  engine unwakeable until restarted: the driver refuses ``sleepLevel: 2`` for this adapter
  at prepare, and the adapter refuses it too.
- **Omni's sleep does not drain**: a request running on a stage loses its memory under it.
  So the adapter first waits (within ``Timeouts.sleep_s``) until the engine's own gauges
  say nothing runs or waits, and does not sleep an engine that is still busy. Without
  those gauges (stats logging off) it cannot wait, and says so in its log.
- ``/v1/omni/*`` lies under ``/v1``: with ``--api-key`` it needs the engine's API key,
  which the adapter sends there (and rota's control token, for the engine guard).
- **It needs** ``VLLM_SERVER_DEV_MODE=1`` **too**: ``GET /is_sleeping`` (one global flag,
  through which every sleep and wake is confirmed) and ``POST /reset_prefix_cache`` (sent
  after every wake, vllm-omni#6442; a no-op in 0.26) are vLLM's development routes.
- Stage ids come from the claim's ``omniStageIds`` (required: Omni has no call that lists
  them, and Qwen2.5-Omni and Qwen3-Omni pipelines have three stages).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, ValidationError

from controller.lease.engines.base import (
    EngineEndpoint,
    SleepOutcome,
    StageAck,
    Timeouts,
    WakeOutcome,
    check_level,
)
from controller.lease.engines.common import ALL_TAGS, HttpEngineAdapter, Step
from controller.lease.engines.dialect import detect
from controller.lease.engines.errors import (
    EngineProtocolError,
    EngineRejected,
    EngineTimeout,
    is_gpu_oom,
    truncate,
)
from controller.lease.engines.transport import Answer
from controller.lease.engines.vllm import RESET_PREFIX_CACHE, check_reset_answer
from rota.api.engine_config import ProbeConfig
from rota.kit.aio import Backoff

__all__ = ["OMNI_LEVELS", "OmniAck", "OmniAnswer", "VllmOmniAdapter", "parse_acks"]

log = logging.getLogger(__name__)

OMNI_LEVELS = (1,)
"""Sleep levels vLLM-Omni can wake from (0.26 and 0.30 cannot wake after level 2)."""
_OK_STATUSES = frozenset({"SUCCESS", "SKIPPED"})
DRAIN_POLL_FIRST_S = 0.02
DRAIN_POLL_MAX_S = 0.5
"""How often the drain before an Omni sleep reads the gauges (growing, jittered)."""


def _gib(value: object) -> float | None:
    """A GiB figure of an ACK's metadata: a number, or a numeric string as Omni sends."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None


class OmniAck(BaseModel):
    """vLLM-Omni's ``OmniACK``; fields Omni may add later are ignored."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    task_id: str
    status: str
    stage_id: int | None = None
    rank: int | None = None
    freed_bytes: int = 0
    metadata: dict[str, Any] = {}
    error_msg: str | None = None

    def to_stage_ack(self) -> StageAck:
        return StageAck(
            task_id=self.task_id, status=self.status, stage_id=self.stage_id, rank=self.rank,
            freed_bytes=self.freed_bytes,
            total_freed_gib=_gib(self.metadata.get("total_freed_gib")),
            rank_residual_gib=_gib(self.metadata.get("rank_residual_gib")),
            error_msg=self.error_msg,
        )


class OmniAnswer(BaseModel):
    """The body of ``/v1/omni/sleep`` and ``/v1/omni/wakeup`` (SKIPPED has no ``acks``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    status: str
    acks: list[OmniAck] = []


def parse_acks(answer: Answer, *, step: str) -> tuple[StageAck, ...]:
    """The ACKs of an Omni answer; raises unless every one (and the whole) succeeded."""
    try:
        parsed = OmniAnswer.model_validate(answer.json(step))
    except ValidationError as exc:
        raise EngineProtocolError(f"{step}: the answer is not an Omni ACK list", step=step,
                                  body=answer.body) from exc
    failed = [ack for ack in parsed.acks if ack.status != "SUCCESS"]
    if failed:
        first = failed[0]
        message = first.error_msg or f"ACK status {first.status}"
        reason = "gpu_oom" if is_gpu_oom(message) else "ack_error"
        raise EngineRejected(
            f"{step}: stage {first.stage_id} rank {first.rank} failed: {truncate(message)}",
            step=step, status=answer.status, body=answer.body, reason=reason,
        )
    if parsed.status not in _OK_STATUSES:
        raise EngineRejected(f"{step}: overall status {truncate(parsed.status, 40)!r}",
                             step=step, status=answer.status, body=answer.body,
                             reason="ack_error")
    return tuple(ack.to_stage_ack() for ack in parsed.acks)


def _check_omni_level(level: int) -> int:
    if check_level(level) not in OMNI_LEVELS:
        raise ValueError("vLLM-Omni cannot wake after a level-2 sleep (501, the engine stays "
                         "asleep until restarted): use sleep level 1")
    return level


class VllmOmniAdapter(HttpEngineAdapter):
    """Drives a vLLM-Omni engine through its stage-aware sleep and wakeup (level 1)."""

    reads_sleep_gauge = False  # Omni's stage calls do not record vllm:engine_sleep_state
    sleep_step = "omni_sleep"
    wake_step = "omni_wakeup"

    def __init__(
        self,
        endpoint: EngineEndpoint,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        *,
        stage_ids: Sequence[int],
        probe: ProbeConfig | None = None,
    ) -> None:
        super().__init__(endpoint, session, timeouts, probe=probe)
        chosen = tuple(stage_ids)
        if not chosen or any(type(s) is not int or s < 0 for s in chosen):
            raise ValueError(f"stage ids must be non-negative integers, not {chosen!r}")
        self.stage_ids = chosen
        self._wakeup = Step("omni_wakeup", "/v1/omni/wakeup",
                            json_body={"stage_ids": list(chosen)}, wakes=ALL_TAGS)
        self._reset = Step(RESET_PREFIX_CACHE, "/reset_prefix_cache")

    async def preflight(self) -> None:
        """The vLLM under vLLM-Omni must be a release rota supports (:mod:`.dialect`)."""
        await detect(self._http, "vllm-omni")

    async def drain(self, *, deadline: float) -> bool:
        """Wait until the engine's gauges say no request runs or waits; True when drained,
        False when the engine has no such gauges. :class:`EngineTimeout` at ``deadline``."""
        backoff = Backoff(first_s=DRAIN_POLL_FIRST_S, max_s=DRAIN_POLL_MAX_S)
        while True:
            busy = await self.in_flight()
            if busy is None:
                log.warning("cannot drain before an Omni sleep: the engine exports no "
                            "in-flight gauges (stats logging off?)", extra=(
                                self.endpoint.log_fields()))
                return False
            if busy == 0:
                return True
            pause = backoff.next_delay()
            if time.monotonic() + pause >= deadline:
                raise EngineTimeout(
                    f"omni_drain: {busy} request(s) still in flight; vLLM-Omni's sleep would "
                    "unmap their memory under them, so the engine is not put to sleep",
                    step="omni_drain", timeout_s=self.timeouts.sleep_s)
            await backoff.sleep()

    async def sleep(self, level: int, *, confirm: bool = True, keep: bool = False
                    ) -> SleepOutcome:
        _check_omni_level(level)
        if keep:  # can_keep says no: its stages sleep under running requests
            raise ValueError("vLLM-Omni's sleep cannot keep requests in flight")
        budget_s = self.timeouts.sleep_s
        began = time.monotonic()
        await self.drain(deadline=began + budget_s)
        step = Step("omni_sleep", "/v1/omni/sleep",
                    json_body={"stage_ids": list(self.stage_ids), "level": level})
        remaining = budget_s - (time.monotonic() - began)
        sleep_s, answer = await self._sleep_call(step, budget_s=remaining)
        acks = parse_acks(answer, step=step.name)
        if confirm:
            await self.confirm_asleep(level)
        freed = sum(ack.freed_bytes for ack in acks)
        log.info("engine asleep", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(sleep_s, 6), "stage_ids": self.stage_ids,
            "freed_bytes": freed, "confirmed": confirm})
        return SleepOutcome(level=level, sleep_s=sleep_s, freed_bytes=freed, acks=acks)

    def _wake_steps(self, level: int) -> Sequence[Step]:
        _check_omni_level(level)
        return (self._wakeup, self._reset)

    def _check_answer(self, step: Step, answer: Answer) -> None:
        if step.name == RESET_PREFIX_CACHE:
            check_reset_answer(step.name, answer)
        elif step.name == self._wakeup.name:
            parse_acks(answer, step=step.name)

    async def _wake_from(self, level: int, start: int, *, confirm: bool = True
                         ) -> WakeOutcome:
        steps = self._wake_steps(level)
        wake_s, timings, answers = await self._run_wake(level, steps, start=start,
                                                        budget_s=self.timeouts.wake_s(level))
        acks = parse_acks(answers[0], step=self._wakeup.name) if start == 0 else ()
        if confirm:
            await self.confirm_awake()
        log.info("engine awake", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(wake_s, 6), "stage_ids": self.stage_ids,
            "confirmed": confirm,
            "steps": {t.name: round(t.seconds, 6) for t in timings}})
        return WakeOutcome(level=level, wake_s=wake_s, steps=tuple(timings), acks=acks)
