"""vLLM-Omni's stage-aware sleep endpoints (served with ``--omni``), as in vLLM-Omni 0.26.

- ``POST /v1/omni/sleep`` ``{"stage_ids": [int, ...], "level": int}`` (level defaults to
  2) puts each stage to sleep at once: vLLM-Omni **does not pause or drain** (a request
  running on a stage loses its memory under it and fails; new requests are rejected with
  500 "Generation rejected: Engine is partially or fully asleep"). Answers
  ``{"status": "SUCCESS", "acks": [...]}``, one ACK per stage (rank 0) with the bytes it
  freed; ``metadata.total_freed_gib`` and ``rank_residual_gib`` are **strings** ("4.50").
- ``POST /v1/omni/wakeup`` ``{"stage_ids": [...]}`` wakes the stages that are asleep, or
  answers ``{"status": "SKIPPED", "reason": ...}`` (no ``acks``) when none is. After a
  level-2 sleep it answers **501** ``NotImplementedError`` and the engine can never be
  woken again until it restarts (fault ``omni_level2_wake`` makes it reload and work).
- A stage id the pipeline does not have gives 500 before anything happens; a body that is
  not valid gives 400 in vLLM's error shape.

Like every ``/v1`` path, both need the API key when the engine has one.
"""

from __future__ import annotations

import json
import logging
from typing import TypeVar

from aiohttp import web
from pydantic import BaseModel, ValidationError

from e2e.engine_simulator.control_api import respond_then_crash
from e2e.engine_simulator.errors import SimError
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.state import StateError

__all__ = ["OmniSleepRequest", "OmniWakeupRequest", "omni_routes"]

log = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=BaseModel)

LEVEL2_WAKE_NOT_IMPLEMENTED = (
    "wake_up() after sleep(level=2) is not yet implemented for the Omni orchestrator. "
    "Use sleep(level=1) instead.")


class OmniSleepRequest(BaseModel):
    stage_ids: list[int]
    level: int = 2


class OmniWakeupRequest(BaseModel):
    stage_ids: list[int]


async def _parse(request: web.Request, schema: type[_Body]) -> _Body:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SimError(f"JSON decode error: {exc}", err_type="Bad Request") from exc
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        raise SimError(str(exc.errors(include_url=False)), err_type="Bad Request") from exc


def _stage_ids(request: web.Request, stage_ids: list[int]) -> list[int]:
    try:
        return request.app[ENGINE_KEY].state.check_stage_ids(stage_ids)
    except StateError as exc:
        raise SimError(f"IndexError: {exc}", status=500,
                       err_type="InternalServerError") from exc


async def omni_sleep(request: web.Request) -> web.Response:
    body = await _parse(request, OmniSleepRequest)
    if body.level not in (1, 2):
        raise SimError(f"sleep level must be 1 or 2, not {body.level}")
    engine = request.app[ENGINE_KEY]
    acks = []
    for stage in _stage_ids(request, body.stage_ids):
        ops = await engine.omni_sleep(level=body.level, stage_ids=[stage], request=request)
        acks.append(engine.omni_ack(stage, engine.freed_bytes(ops)))
    result = {"status": "SUCCESS", "acks": acks}
    if engine.faults.crash_on_sleep:
        return await respond_then_crash(request, "crash_on_sleep", result)
    return web.json_response(result)


async def omni_wakeup(request: web.Request) -> web.Response:
    body = await _parse(request, OmniWakeupRequest)
    engine = request.app[ENGINE_KEY]
    asleep = [s for s in _stage_ids(request, body.stage_ids) if engine.state.stage_asleep(s)]
    if not asleep:
        return web.json_response({"status": "SKIPPED",
                                  "reason": "Target stages are not sleeping."})
    if engine.omni_level2_latched and not engine.faults.omni_level2_wake:
        raise SimError(LEVEL2_WAKE_NOT_IMPLEMENTED, status=501, err_type="NotImplementedError")
    await engine.wake(stage_ids=asleep, reload_weights=True, request=request)
    if not engine.state.is_sleeping:
        engine.omni_level2_latched = False
    return web.json_response(
        {"status": "SUCCESS", "acks": [engine.omni_ack(stage, 0) for stage in asleep]}
    )


def omni_routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/omni/sleep", omni_sleep),
        web.post("/v1/omni/wakeup", omni_wakeup),
    ]
