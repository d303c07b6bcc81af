"""Simulator-only endpoints under ``/sim/``: no real engine has them.

- ``GET /sim/state``: sleep state, in-flight counts, memory held, sleep and wake history
  with durations (and measured copy times on the cuda backend), faults.
- ``GET /sim/faults``: the faults in force.
- ``POST /sim/faults``: a JSON object of booleans naming the faults to change; answers the
  faults now in force. ``{"crash_now": true}`` answers 200, then the process exits hard.
- ``GET /sim/headers``: the credential headers this engine has received
  (:mod:`e2e.engine_simulator.recorder`).
"""

from __future__ import annotations

import logging

from aiohttp import web
from pydantic import ValidationError

from e2e.engine_simulator.control_api import respond_then_crash
from e2e.engine_simulator.errors import SimError
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.recorder import recorded_headers
from e2e.engine_simulator.settings import FaultsPatch

__all__ = ["sim_routes"]

log = logging.getLogger(__name__)


async def state(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE_KEY].snapshot())


async def get_faults(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE_KEY].faults.model_dump())


async def set_faults(request: web.Request) -> web.Response:
    raw = await request.read()
    try:
        patch = FaultsPatch.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise SimError(f"invalid faults: {exc}") from exc
    engine = request.app[ENGINE_KEY]
    faults = await engine.set_faults(patch)
    if faults.crash_now:
        return await respond_then_crash(request, "crash_now", faults.model_dump())
    return web.json_response(faults.model_dump())


def sim_routes() -> list[web.RouteDef]:
    return [
        web.get("/sim/state", state),
        web.get("/sim/faults", get_faults),
        web.post("/sim/faults", set_faults),
        web.get("/sim/headers", recorded_headers),
    ]


