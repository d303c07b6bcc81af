"""vLLM-Omni's stage-aware sleep endpoints (served with ``--omni``).

- ``POST /v1/omni/sleep`` ``{"stage_ids": [int, ...], "level": int}`` (level defaults to 2)
  puts each stage to sleep, aborting running generations (Omni implements only ``abort``),
  and answers ``{"status": "SUCCESS", "acks": [...]}`` with one ACK per stage carrying the
  bytes it freed.
- ``POST /v1/omni/wakeup`` ``{"stage_ids": [...]}`` wakes the stages that are asleep
  (reloading level-2 weights itself) or answers ``{"status": "SKIPPED", "acks": []}``
  when none is. As in vllm-omni#6442, a level-2 stage keeps a stale prefix cache until
  ``POST /reset_prefix_cache``.

Bodies are validated like FastAPI does: 422 with ``{"detail": [...]}``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from e2e.engine_simulator.control_api import respond_then_crash
from e2e.engine_simulator.errors import SimError
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.state import StateError

__all__ = ["OmniSleepRequest", "OmniWakeupRequest", "omni_routes"]

log = logging.getLogger(__name__)

_Body = TypeVar("_Body", bound=BaseModel)


class OmniSleepRequest(BaseModel):
    stage_ids: list[int] = Field(min_length=1)
    level: int = Field(default=2, ge=0)


class OmniWakeupRequest(BaseModel):
    stage_ids: list[int] = Field(min_length=1)


def _unprocessable(detail: list[dict[str, Any]]) -> web.HTTPException:
    return web.HTTPUnprocessableEntity(
        text=json.dumps({"detail": detail}), content_type="application/json"
    )


async def _parse(request: web.Request, schema: type[_Body]) -> _Body:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise _unprocessable([{"type": "json_invalid", "loc": ["body"], "msg": str(exc)}]) from exc
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        detail = json.loads(exc.json(include_url=False))
        for err in detail:
            err["loc"] = ["body", *err.get("loc", [])]
        raise _unprocessable(detail) from exc


def _stage_ids(request: web.Request, stage_ids: list[int]) -> list[int]:
    try:
        return request.app[ENGINE_KEY].state.check_stage_ids(stage_ids)
    except StateError as exc:
        raise SimError(str(exc)) from exc


async def omni_sleep(request: web.Request) -> web.Response:
    body = await _parse(request, OmniSleepRequest)
    engine = request.app[ENGINE_KEY]
    acks = []
    for stage in _stage_ids(request, body.stage_ids):
        ops = await engine.sleep(level=body.level, mode="abort", stage_ids=[stage],
                                 request=request)
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
        return web.json_response({"status": "SKIPPED", "acks": []})
    await engine.wake(stage_ids=asleep, reload_weights=True, request=request)
    return web.json_response(
        {"status": "SUCCESS", "acks": [engine.omni_ack(stage, 0) for stage in asleep]}
    )


def omni_routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/omni/sleep", omni_sleep),
        web.post("/v1/omni/wakeup", omni_wakeup),
    ]
