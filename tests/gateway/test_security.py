"""What the gateway refuses: control paths, bad credentials, bad or slow request bodies."""

from __future__ import annotations

import asyncio

import pytest

from tests.gateway.conftest import DEADLINE, MODEL_A, MODEL_B, RigFactory

pytestmark = pytest.mark.gateway

CONTROL_PATHS = ["/sleep", "/sleep?level=1", "/wake_up", "/is_sleeping", "/collective_rpc",
                 "/reset_prefix_cache", "/pause", "/resume", "/is_paused", "/v1/omni/sleep",
                 "/v1/omni/wakeup", "/health", "/metrics/engine", "/sim/state", "/sim/faults",
                 "/v1/chat/completions/../../sleep", "/v1/embeddings/../../sleep",
                 "/tokenize/../sleep", "/v1/load_lora_adapter", "/v1/responses/resp_1/cancel",
                 "/invocations"]


def _assert_openai_error(body: dict[str, object], code: str) -> None:
    error = body["error"]
    assert isinstance(error, dict)
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code, error


async def test_control_paths_are_never_proxied(make_rig: RigFactory) -> None:
    rig = await make_rig()
    for path in CONTROL_PATHS:
        for method in ("GET", "POST"):
            async with rig.gateway.request(method, path, json={"model": MODEL_A}) as resp:
                assert resp.status == 404, (method, path, resp.status)
                body = await resp.json()
                # vLLM's own routes say why they are not routed; the rest are unknown.
                _assert_openai_error(body, body["error"]["code"])
                assert body["error"]["code"] in ("not_found", "route_not_routed"), body
    for sim in (rig.a, rig.b):
        assert sim.engine.sleep_count == (1 if sim is rig.b else 0)  # the fixture's own sleep
        assert sim.engine.wake_count == 0
    assert await rig.answer(MODEL_A) == "7"


async def test_wrong_method_on_an_openai_path(make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with rig.gateway.get("/v1/chat/completions") as resp:
        assert resp.status == 405
        _assert_openai_error(await resp.json(), "method_not_allowed")


async def test_api_keys_are_required_when_configured(make_rig: RigFactory) -> None:
    rig = await make_rig(api_keys=["key-one", "key-two"])
    payload = {"model": MODEL_A, "messages": [{"role": "user", "content": "3 + 4"}]}
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "key-one"}):
        async with rig.gateway.post("/v1/chat/completions", json=payload,
                                    headers=headers) as resp:
            assert resp.status == 401
            _assert_openai_error(await resp.json(), "invalid_api_key")
        async with rig.gateway.get("/v1/models", headers=headers) as resp:
            assert resp.status == 401
    async with rig.gateway.post("/v1/chat/completions", json=payload,
                                headers={"Authorization": "Bearer key-two"}) as resp:
        assert resp.status == 200
        assert "Authorization" not in resp.headers
    async with rig.gateway.get("/healthz") as resp:
        assert resp.status == 200


async def test_bad_requests_get_clear_4xx(make_rig: RigFactory) -> None:
    rig = await make_rig(max_body_bytes=4096)
    headers = {"Content-Type": "application/json"}
    cases: list[tuple[bytes, int, str]] = [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b"\xff\xfe", 400, "invalid_json"),
        (b'{"messages": []}', 400, "missing_model"),
        (b'{"model": 7}', 400, "missing_model"),
        (b'{"model": "sim/model-a", "stream": "yes"}', 400, "invalid_value"),
        (b'{"model": "no/such-model", "messages": []}', 404, "model_not_found"),
        (b'{"model": "x", "pad": "' + b"x" * 5000 + b'"}', 413, "request_too_large"),
    ]
    for body, status, code in cases:
        async with rig.gateway.post("/v1/chat/completions", data=body,
                                    headers=headers) as resp:
            assert resp.status == status, (body[:40], await resp.text())
            _assert_openai_error(await resp.json(), code)
        assert await rig.answer(MODEL_A) == "7"
    # A body sent in chunks without a length is still cut at the limit.

    async def chunks() -> object:
        for _ in range(10):
            yield b"x" * 1000

    async with rig.gateway.post("/v1/completions", data=chunks(), headers=headers) as resp:
        assert resp.status == 413
    assert rig.controller.calls == 0


async def test_a_slow_client_gets_408_and_others_are_served(make_rig: RigFactory) -> None:
    rig = await make_rig(body_timeout_s=0.5)
    port = rig.gateway.port
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
                     b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                     b'{"model": "sim/')
        await writer.drain()
        others = await asyncio.gather(rig.answer(MODEL_A), rig.answer(MODEL_B))
        assert list(others) == ["7", "7"]
        async with asyncio.timeout(DEADLINE):
            status_line = await reader.readline()
            answer = await reader.read()
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        assert b'"request_timeout"' in answer
    finally:
        writer.close()
        await writer.wait_closed()
