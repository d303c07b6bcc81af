"""vLLM 0.26's whole route surface, as read from the real wheel into
``controller/gateway/vllm_routes.json`` (``e2e/tools/vllm_routes.py``): every model-bearing route
is routed through the gateway to the engine, with its model read where vLLM reads it (the
JSON body, or the audio upload's form field); every other route answers a 404 naming the
route and why. The audio routes and Anthropic's ``/v1/messages`` go end to end through real
HTTP to the engine simulator, with a switch.
"""

from __future__ import annotations

import asyncio
import json
import zipfile
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from openai import AsyncOpenAI

from controller.gateway.surface import OWN, REFUSED, ROUTED, routed, routed_for
from controller.lease.engines.surfaces import supported, surface_for
from e2e.harness.wire import Exchange, parse_answer, parse_sse
from e2e.tools import vllm_routes
from tests.gateway.conftest import DEADLINE, MODEL_A, MODEL_B, Failure, Rig, RigFactory
from tests.gateway.surface_cases import JSON_CASES

pytestmark = pytest.mark.gateway

TABLE = Path(__file__).resolve().parents[2] / "controller" / "gateway" / "vllm_routes.json"


def _table() -> vllm_routes.RouteTable:
    return vllm_routes.load(TABLE)


# -- the table against the gateway's surface ---------------------------------------------


def test_the_table_is_vllm_0_26_read_from_its_wheel() -> None:
    table = _table()
    assert table.vllm == "0.26.0"
    keys = {route.key for route in table.routes}
    # A few routes anyone would miss if the table were written by hand.
    assert {("POST", "/v1/audio/transcriptions"), ("POST", "/v1/messages"),
            ("POST", "/v2/rerank"), ("WEBSOCKET", "/v1/realtime"),
            ("POST", "/sleep")} <= keys


def test_every_model_bearing_route_of_vllm_is_routed() -> None:
    missing = [route.key for route in _table().routes
               if route.model == "yes" and (route.method != "POST" or routed(route.path)
                                             is None)]
    assert not missing, f"vLLM serves these by model; the gateway does not route them: " \
        f"{missing}"


def test_every_other_route_of_vllm_is_the_gateway_s_own_or_refused_with_a_reason() -> None:
    unclassified = []
    for route in _table().routes:
        if route.model == "yes":
            continue
        reason = OWN.get(route.key) or REFUSED.get(route.key)
        if not reason or len(reason) < 20:
            unclassified.append(route.key)
    assert not unclassified, f"neither routed nor refused with a reason: {unclassified}"


def test_the_gateway_names_no_route_vllm_does_not_have() -> None:
    table = _table().by_key()
    stale = [key for key in (*OWN, *REFUSED) if key not in table]
    assert not stale, f"not routes of vLLM 0.26: {stale}"


@pytest.mark.parametrize("version", supported("vllm"))
def test_each_release_serves_the_routes_routed_for_it_and_reads_each_model_right(
        version: str) -> None:
    """Each supported release's own table (read from its wheel), not 0.26's alone: the
    routes routed for it are routes of it that name a model where the gateway reads it,
    and the routes newer than it are not routes of it."""
    surface = surface_for(version)
    assert surface is not None
    table = surface.table().by_key()
    mine = {route.path for route in routed_for(version)}
    for route in ROUTED:
        vllm = table.get(("POST", route.path))
        if route.path not in mine:
            assert vllm is None, f"{version} serves {route.path} (since {route.since}?)"
            continue
        assert vllm is not None, f"{version} does not serve {route.path}"
        if route.path in _DERENDER and version != "0.26.0":
            continue  # a union (stream or not) the wheel reader cannot follow; each names model
        assert vllm.model == "yes", (version, route)
        assert route.body == vllm.body, f"{route.path}: vLLM {version} reads a {vllm.body} body"


_DERENDER = ("/v1/chat/completions/derender", "/v1/completions/derender")


def test_every_routed_json_route_has_a_case_sent_end_to_end() -> None:
    assert {path for path, _, _ in JSON_CASES} == {r.path for r in ROUTED if r.body == "json"}


# -- the gateway's answers ----------------------------------------------------------------


async def test_each_refused_route_is_a_404_that_names_it_and_why(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    for (method, path), reason in sorted(REFUSED.items()):
        url = path.replace("{response_id}", "resp_1")
        headers = {"Connection": "Upgrade", "Upgrade": "websocket"} \
            if method == "WEBSOCKET" else {}
        verb = "GET" if method == "WEBSOCKET" else method
        async with rig.gateway.request(verb, url, headers=headers) as resp:
            assert resp.status == 404, (method, path)
            error = (await resp.json())["error"]
        assert error["code"] == "route_not_routed", (method, path)
        assert f"{verb} {path}" in error["message"]
        assert reason in error["message"]
        assert error["type"] == "invalid_request_error"
    assert rig.controller.calls == 0
    async with rig.b.client.get("/is_sleeping") as resp:
        assert (await resp.json())["is_sleeping"], "no control call reached an engine"


async def test_each_routed_route_reads_the_model_before_anything_else(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    for route in ROUTED:
        if route.body == "json":
            async with rig.gateway.post(route.path, json={"prompt": "x"}) as resp:
                assert resp.status == 400, route.path
                assert (await resp.json())["error"]["code"] == "missing_model", route.path
        else:
            form = aiohttp.FormData()
            form.add_field("file", b"three plus four", filename="a.wav",
                           content_type="audio/wav")
            async with rig.gateway.post(route.path, data=form) as resp:
                assert resp.status == 400, route.path
                assert (await resp.json())["error"]["code"] == "missing_model", route.path
    assert rig.controller.calls == 0


# -- audio: multipart uploads --------------------------------------------------------------


def _sdk(rig: Rig) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(rig.gateway.make_url("/v1")), api_key="unused",
                       max_retries=0, timeout=DEADLINE)


async def test_the_sdk_transcribes_and_translates_through_the_gateway_with_switches(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with _sdk(rig) as sdk:
        # B is asleep: its upload waits for the switch, then reaches B whole.
        heard = await sdk.audio.transcriptions.create(
            model=MODEL_B, file=("speech.wav", b"what is three plus four", "audio/wav"))
        assert heard.text == "what is three plus four"
    # The SDK's translations call is deprecated: the same upload, as it sends it.
    form = aiohttp.FormData()
    form.add_field("model", MODEL_A)
    form.add_field("file", b"was ist drei plus vier", filename="speech.wav",
                   content_type="audio/wav")
    async with rig.gateway.post("/v1/audio/translations", data=form) as resp:
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["text"] == "was ist drei plus vier"
    assert rig.controller.switches == 2
    assert rig.controller.max_awake == 1


async def test_a_streamed_transcription_is_kept_alive_while_its_model_is_switched_in(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=0.05)
    rig.controller.hold_switch = asyncio.Event()
    form = aiohttp.FormData()
    form.add_field("model", MODEL_B)
    form.add_field("stream", "true")
    form.add_field("file", b"seven it is", filename="a.wav", content_type="audio/wav")
    async with rig.gateway.post("/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        seen = b""
        async with asyncio.timeout(DEADLINE):
            while b": rota:" not in seen:
                seen += await resp.content.readany()
        rig.controller.hold_switch.set()
        body = seen + await resp.content.read()
    events = parse_sse(body)
    words = [e.data["choices"][0]["delta"]["content"] for e in events
             if isinstance(e.data, dict)]
    assert "".join(words) == "seven it is"
    assert events[-1].data == "[DONE]"


async def test_an_upload_larger_than_a_json_body_is_taken_up_to_its_own_limit(
        make_rig: RigFactory) -> None:
    rig = await make_rig(max_body_bytes=4096, max_upload_bytes=64 * 1024)
    spoken = ("three plus four " * 1000).strip().encode()  # 16 KB: above the JSON limit
    async with _sdk(rig) as sdk:
        heard = await sdk.audio.transcriptions.create(
            model=MODEL_A, file=("speech.wav", spoken, "audio/wav"))
    assert heard.text.encode() == spoken
    form = aiohttp.FormData()
    form.add_field("model", MODEL_A)
    form.add_field("file", b"x" * 70 * 1024, filename="a.wav", content_type="audio/wav")
    async with rig.gateway.post("/v1/audio/transcriptions", data=form) as resp:
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "request_too_large"


async def test_a_body_that_is_not_a_form_is_refused_on_the_audio_routes(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with rig.gateway.post("/v1/audio/transcriptions",
                                json={"model": MODEL_A, "file": "x"}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == "invalid_form"
    assert "multipart/form-data" in error["message"]
    async with rig.gateway.post(
            "/v1/audio/translations", data=b"--b\r\nbroken",
            headers={"Content-Type": "multipart/form-data; boundary=b"}) as resp:
        assert resp.status == 400
        assert (await resp.json())["error"]["code"] == "invalid_form"
    assert rig.controller.calls == 0


# -- Anthropic's Messages API ---------------------------------------------------------------


def _anthropic_events(body: bytes) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for event in parse_sse(body):
        if event.type is not None:
            assert isinstance(event.data, dict)
            assert event.data["type"] == event.type
            out.append((event.type, event.data))
    return out


async def test_a_streamed_message_waits_for_its_switch_and_arrives_whole(
        make_rig: RigFactory) -> None:
    rig = await make_rig(stream_keepalive_s=0.05)
    rig.controller.hold_switch = asyncio.Event()
    body = {"model": MODEL_B, "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": "What is 3 + 4?"}]}
    exchange = await Exchange.post(_port(rig), "/v1/messages", body)
    try:
        await exchange.read_until(b": rota: ")
        rig.controller.hold_switch.set()
        answer = parse_answer(await exchange.read_all())
    finally:
        await exchange.close()
    assert answer.status == 200
    events = _anthropic_events(answer.body)
    kinds = [kind for kind, _ in events]
    assert (kinds[0], kinds[-1]) == ("message_start", "message_stop")
    assert "".join(e["delta"]["text"] for kind, e in events
                   if kind == "content_block_delta") == "7"
    # Its first text delta is its first token, as a chat chunk's content is.
    metrics = await (await rig.gateway.get("/metrics")).text()
    assert (f'rota_gateway_first_token_duration_seconds_count{{model_name="{MODEL_B}"}} 1.0'
            in metrics)


async def test_a_refusal_inside_a_started_message_stream_is_anthropic_s_error_event(
        make_rig: RigFactory) -> None:
    """Anthropic's clients read ``event: error`` (as vLLM sends it); an OpenAI-style
    ``data: {"error": ...}`` and ``[DONE]`` would end their stream silently unfinished."""
    rig = await make_rig(stream_keepalive_s=0.05)
    rig.controller.failure = Failure(503, "gpu_oom", retry_after=7)
    rig.controller.hold_answer = asyncio.Event()
    body = {"model": MODEL_B, "max_tokens": 16, "stream": True,
            "messages": [{"role": "user", "content": "What is 3 + 4?"}]}
    exchange = await Exchange.post(_port(rig), "/v1/messages", body)
    try:
        await exchange.read_until(b": rota: ")
        rig.controller.hold_answer.set()
        answer = parse_answer(await exchange.read_all())
    finally:
        await exchange.close()
    assert answer.status == 200
    assert b"[DONE]" not in answer.body
    events = _anthropic_events(answer.body)
    assert [kind for kind, _ in events] == ["error"]
    error = events[0][1]["error"]
    assert error["code"] == "gpu_oom"
    assert error["type"] == "service_unavailable"
    assert error["message"]


async def test_a_message_refused_before_any_start_has_anthropic_s_error_shape(
        make_rig: RigFactory) -> None:
    rig = await make_rig()
    async with rig.gateway.post("/v1/messages", json={
            "model": "no/such", "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 404
        body = await resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["code"] == "model_not_found"


def _port(rig: Rig) -> int:
    port = rig.gateway.port
    assert port is not None
    return port


# -- the script that reads the wheel --------------------------------------------------------


_ROUTER = '''
from typing import Annotated, TypeAlias
from fastapi import APIRouter, Form, Request
router = APIRouter()

class Base(BaseModel):
    model: str | None = None

class ChatRequest(Base):
    messages: list

class SpeechRequest(BaseModel):
    model: str

class ControlRequest(BaseModel):
    level: int

EitherRequest: TypeAlias = Annotated[ChatRequest | ControlRequest, Field(discriminator="x")]

@router.post("/v1/chat")
async def chat(request: ChatRequest, raw_request: Request): ...

@router.post("/v1/speech")
async def speech(raw_request: Request, request: Annotated[SpeechRequest, Form()]): ...

@router.post("/either")
async def either(request: EitherRequest, raw_request: Request): ...

@router.post("/sleep")
async def sleep(raw_request: Request, level: int = 1): ...

@router.get("/things/{thing_id}")
async def thing(thing_id: str, stream: bool = False): ...

@router.post("/built")
async def built(raw_request: Request):
    return ChatRequest(**(await raw_request.json()))

@router.websocket("/v1/live")
async def live(websocket: WebSocket): ...
'''


def _wheel(tmp_path: Path, version: str, extra: str = "") -> Path:
    path = tmp_path / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr("vllm/entrypoints/x/api_router.py", _ROUTER + extra)
        wheel.writestr("vllm/other.py", "@router.post('/not/an/entrypoint')\ndef f(): ...\n")
    return path


def test_the_script_reads_routes_bodies_and_models_from_a_wheel(tmp_path: Path) -> None:
    table = vllm_routes.extract(_wheel(tmp_path, "9.9.9")).by_key()
    assert {key: (r.body, r.model, r.request_class) for key, r in table.items()} == {
        ("POST", "/v1/chat"): ("json", "yes", "ChatRequest"),
        ("POST", "/v1/speech"): ("form", "yes", "SpeechRequest"),
        ("POST", "/either"): ("json", "yes", "EitherRequest"),
        ("POST", "/sleep"): ("raw", "unknown", None),
        ("GET", "/things/{thing_id}"): ("none", "no", None),
        ("POST", "/built"): ("json", "yes", "ChatRequest"),
        ("WEBSOCKET", "/v1/live"): ("none", "no", None),
    }


def test_the_script_writes_a_table_and_fails_a_check_against_a_changed_wheel(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "routes.json"
    assert vllm_routes.main([str(_wheel(tmp_path, "9.9.9")), "--write", str(out)]) == 0
    assert json.loads(out.read_text())["vllm"] == "9.9.9"
    assert vllm_routes.main([str(_wheel(tmp_path, "9.9.9")), "--check", str(out)]) == 0
    (tmp_path / "newer").mkdir()
    newer = _wheel(tmp_path / "newer", "9.9.10",
                   extra='\n@router.post("/v1/new")\nasync def new(request: ChatRequest): ...\n')
    capsys.readouterr()
    assert vllm_routes.main([str(newer), "--check", str(out)]) == 1
    said = capsys.readouterr().out
    assert "new route: POST /v1/new" in said
    assert "version: committed 9.9.9, wheel 9.9.10" in said
    assert vllm_routes.main([str(out), "--check", str(out)]) == 2  # not a wheel
