"""The adapter for vLLM-Omni, whose stages sleep and wake through stage-aware calls.

- Sleep: ``POST /v1/omni/sleep`` ``{"stage_ids": [...], "level": N}``; wake:
  ``POST /v1/omni/wakeup`` ``{"stage_ids": [...]}`` (Omni reloads level-2 weights itself).
  Both answer ``{"status": "SUCCESS"|"SKIPPED", "acks": [...]}``, one ACK per stage and
  rank with the bytes it freed. Any ACK with status ``ERROR`` fails the call
  (:class:`~controller.engines.errors.EngineRejected`, reason ``ack_error``, or
  ``gpu_oom`` when its message says the device ran out of memory).
- Omni implements only the ``abort`` pause mode (``wait`` sets a flag and drains nothing),
  and its sleep call takes no mode: the controller's drain at the gateway is the only
  protection of in-flight requests.
- Omni keeps stale prefix-cache block hashes over a woken KV cache (vllm-omni#6442), so
  every wake is followed by ``POST /reset_prefix_cache`` (a vLLM development-mode route).
- State is read and confirmed through the whole-engine ``GET /is_sleeping``.

Stage ids come from the claim's ``omniStageIds``. Omni offers no call that lists stages, so
when it is absent the adapter uses :data:`DEFAULT_STAGE_IDS` ``(0, 1)``, the two-stage
layout of Omni's usual pipelines (and the simulator's default). An engine with one stage
refuses stage 1, which fails loudly; an engine with more stages would keep the others
awake, which the controller's device check before any wake catches. Set ``omniStageIds``
for any other layout.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from pydantic import BaseModel, ConfigDict, ValidationError

from controller.engines.base import (
    EngineEndpoint,
    SleepOutcome,
    StageAck,
    StepTiming,
    Timeouts,
    WakeOutcome,
    check_level,
)
from controller.engines.common import HttpEngineAdapter, Step
from controller.engines.errors import EngineProtocolError, EngineRejected, is_gpu_oom, truncate
from controller.engines.transport import Answer

__all__ = ["DEFAULT_STAGE_IDS", "OmniAck", "OmniAnswer", "VllmOmniAdapter", "parse_acks"]

log = logging.getLogger(__name__)

DEFAULT_STAGE_IDS: tuple[int, ...] = (0, 1)
_RESET_PREFIX_CACHE = Step("reset_prefix_cache", "/reset_prefix_cache")
_OK_STATUSES = frozenset({"SUCCESS", "SKIPPED"})


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
        def gib(key: str) -> float | None:
            value = self.metadata.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float):
                return None
            return float(value)

        return StageAck(
            task_id=self.task_id, status=self.status, stage_id=self.stage_id, rank=self.rank,
            freed_bytes=self.freed_bytes, total_freed_gib=gib("total_freed_gib"),
            rank_residual_gib=gib("rank_residual_gib"), error_msg=self.error_msg,
        )


class OmniAnswer(BaseModel):
    """The body of ``/v1/omni/sleep`` and ``/v1/omni/wakeup``."""

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


class VllmOmniAdapter(HttpEngineAdapter):
    """Drives a vLLM-Omni engine through its stage-aware sleep and wakeup."""

    def __init__(
        self,
        endpoint: EngineEndpoint,
        session: aiohttp.ClientSession,
        timeouts: Timeouts,
        *,
        stage_ids: Sequence[int] | None = None,
    ) -> None:
        super().__init__(endpoint, session, timeouts)
        chosen = tuple(stage_ids) if stage_ids is not None else DEFAULT_STAGE_IDS
        if not chosen or any(type(s) is not int or s < 0 for s in chosen):
            raise ValueError(f"stage ids must be non-negative integers, not {chosen!r}")
        self.stage_ids = chosen
        self._wakeup = Step("omni_wakeup", "/v1/omni/wakeup",
                            json_body={"stage_ids": list(chosen)})

    async def sleep(self, level: int) -> SleepOutcome:
        step = Step("omni_sleep", "/v1/omni/sleep",
                    json_body={"stage_ids": list(self.stage_ids), "level": check_level(level)})
        sleep_s, _, [answer] = await self._run_steps([step], budget_s=self.timeouts.sleep_s)
        acks = parse_acks(answer, step=step.name)
        await self._confirm(sleeping=True, after="omni_sleep")
        freed = sum(ack.freed_bytes for ack in acks)
        log.info("engine asleep", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(sleep_s, 6), "stage_ids": self.stage_ids,
            "freed_bytes": freed})
        return SleepOutcome(level=level, sleep_s=sleep_s, freed_bytes=freed, acks=acks)

    async def wake(self, level: int) -> WakeOutcome:
        budget_s = self.timeouts.wake_s(level)
        began = time.monotonic()
        deadline = began + budget_s
        timings: list[StepTiming] = []
        answer = await self._run_step(self._wakeup, deadline=deadline, budget_s=budget_s,
                                      timings=timings)
        acks = parse_acks(answer, step=self._wakeup.name)
        await self._run_step(_RESET_PREFIX_CACHE, deadline=deadline, budget_s=budget_s,
                             timings=timings)
        wake_s = time.monotonic() - began
        await self._confirm(sleeping=False, after="omni_wakeup")
        log.info("engine awake", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(wake_s, 6), "stage_ids": self.stage_ids,
            "steps": {t.name: round(t.seconds, 6) for t in timings}})
        return WakeOutcome(level=level, wake_s=wake_s, steps=tuple(timings), acks=acks)
