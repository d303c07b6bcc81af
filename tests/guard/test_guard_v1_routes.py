"""Under ``/v1`` only client routes pass with the API key.

The old guard let every ``/v1/*`` path through as client traffic, but vLLM serves engine
administration there: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (every
release), ``/v1/fault_tolerance/*`` (0.34). A tenant's API key reached them, though the
gateway refuses them. A recording upstream shows what the engine receives.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path
from typing import Any

import pytest

from controller.guard.paths import Access, classify
from tests.guard.guard_kit import API_KEY_ONLY, GuardedRecorder, guard_over_recorder

ENGINE_ADMINISTRATION = [
    ("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/v1/fault_tolerance/apply"), ("GET", "/v1/fault_tolerance/status"),
]


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[GuardedRecorder]:
    async with guard_over_recorder(tmp_path) as guarded:
        yield guarded


@pytest.mark.parametrize(("method", "path"), ENGINE_ADMINISTRATION)
async def test_the_api_key_does_not_reach_vllms_v1_administration(
    guarded: GuardedRecorder, method: str, path: str
) -> None:
    answer = await guarded.send(method, path, API_KEY_ONLY)
    assert (answer.status, guarded.recorder.arrivals) == (404, [])


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
    ("GET", "/v1/responses/resp_1"), ("POST", "/v1/responses/resp_1/cancel"),
])
async def test_client_routes_under_v1_still_pass_with_the_api_key(
    guarded: GuardedRecorder, method: str, path: str
) -> None:
    answer = await guarded.send(method, path, API_KEY_ONLY)
    assert answer.status == 200
    [arrival] = guarded.recorder.arrivals
    assert (arrival.method, arrival.path) == (method, path)


def _surface_routes() -> list[dict[str, Any]]:
    folder = resources.files("controller.lease.engines.vllm_surfaces")
    routes: list[dict[str, Any]] = []
    for entry in folder.iterdir():
        if entry.name.endswith(".json"):
            routes.extend(json.loads(entry.read_text())["routes"])
    return routes


def test_every_model_bearing_v1_route_of_the_surfaces_is_client_traffic() -> None:
    """The allow-list follows the committed surfaces: a new model-bearing ``/v1`` route
    that the guard would hide fails here."""
    hidden = sorted({
        (r["method"], r["path"]) for r in _surface_routes()
        if r["path"].startswith("/v1/") and r.get("model") == "yes"
        and r["method"] != "WEBSOCKET"
        and classify(r["method"], r["path"].replace("{", "x").replace("}", "x"))
        is not Access.CLIENT
    })
    assert hidden == []


@pytest.mark.parametrize(("method", "path"), [
    *ENGINE_ADMINISTRATION, ("GET", "/v1/"), ("GET", "/v1"), ("GET", "/v1/anything_new"),
])
def test_unknown_and_administrative_v1_paths_are_hidden(method: str, path: str) -> None:
    assert classify(method, path) is Access.HIDDEN
