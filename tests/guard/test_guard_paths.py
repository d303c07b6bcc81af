"""The engine guard classifies and forwards one and the same path (review F2).

The old guard classified the raw ``request.path`` and forwarded ``path_qs`` through
aiohttp's client, which removed dot segments: ``POST /v1/../wake_up`` with the API key alone
counted as the OpenAI surface and reached the engine as ``POST /wake_up``. A recording
upstream shows what the engine receives.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.guard.guard_kit import (
    API_KEY_ONLY,
    CONTROL_ONLY,
    GuardedRecorder,
    guard_over_recorder,
)


@pytest.fixture
async def guarded(tmp_path: Path) -> AsyncIterator[GuardedRecorder]:
    async with guard_over_recorder(tmp_path) as guarded:
        yield guarded


@pytest.mark.parametrize("target", [
    "/v1/../wake_up", "/v1/../sleep", "/v1/./../collective_rpc",
    "/v1/%2e%2e/wake_up", "/v1/%2E%2E/wake_up", "/v1/%2e./wake_up",
    "/v1/..%2fwake_up", "/v1/..%2Fwake_up", "/v1/%2e%2e%2fwake_up", "/v1/%252e%252e/wake_up",
    "/v1\\..\\wake_up", "/v1/..%5cwake_up", "/v1/..%5Cwake_up",
    "/v1;x/../wake_up", "/v1/omni/../../wake_up", "/health/../sleep",
    "/v1/../wake_up?tags=weights", "/tokenize/../sleep",
])
async def test_a_dot_segment_or_encoded_separator_never_reaches_a_control_route(
    guarded: GuardedRecorder, target: str
) -> None:
    answer = await guarded.send("POST", target, API_KEY_ONLY)
    assert guarded.recorder.arrivals == []  # old guard: [Arrival('POST', '/wake_up', ...)]
    assert answer.status == 400
    error = json.loads(answer.body)["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    assert "canonical" in error["message"]


@pytest.mark.parametrize("target", [
    "//sleep", "/v1//models", "/v1/models//", "/sleep;x", "/v1/models;v=1",
    "/v1/%73leep", "/v1/a%2fb", "/v1/%ZZ", "/v1/%c3", "/v1/a%00b",
])
async def test_what_a_normaliser_could_rewrite_is_refused(
    guarded: GuardedRecorder, target: str
) -> None:
    """Double slashes, ``;`` parameters, non-canonical or broken percent-encoding: some
    proxy or server on the way would read each as another path, so none is interpreted."""
    answer = await guarded.send("GET", target, API_KEY_ONLY | CONTROL_ONLY)
    assert (answer.status, guarded.recorder.arrivals) == (400, [])


@pytest.mark.parametrize(("target", "headers", "path"), [
    ("/v1/models?x=%2e&y=/../a", API_KEY_ONLY, "/v1/models"),
    ("/v1/responses/a%20b", API_KEY_ONLY, "/v1/responses/a b"),
    ("/v1/responses/caf%C3%A9", API_KEY_ONLY, "/v1/responses/café"),
    ("/v1/videos/v%201/content", API_KEY_ONLY, "/v1/videos/v 1/content"),
    ("/metrics/", CONTROL_ONLY, "/metrics/"),
    ("/is_sleeping?verbose=1", CONTROL_ONLY, "/is_sleeping"),
])
async def test_the_engine_receives_exactly_the_target_that_was_classified(
    guarded: GuardedRecorder, target: str, headers: dict[str, str], path: str
) -> None:
    answer = await guarded.send("GET", target, headers)
    assert answer.status == 200
    [arrival] = guarded.recorder.arrivals
    assert (arrival.method, arrival.raw_path, arrival.path) == ("GET", target, path)


async def test_vllm_omnis_control_prefix_passes_only_with_the_control_token(
    guarded: GuardedRecorder
) -> None:
    assert (await guarded.send("POST", "/v1/omni/sleep", API_KEY_ONLY)).status == 401
    assert (await guarded.send("POST", "/v1/omni//sleep", CONTROL_ONLY)).status == 400
    assert (await guarded.send("POST", "/v1/omni/sleep", CONTROL_ONLY)).status == 200
    assert [a.raw_path for a in guarded.recorder.arrivals] == ["/v1/omni/sleep"]
