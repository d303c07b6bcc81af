"""Property-based tests of the gateway's request bodies and headers (issue 28).

Bodies (JSON objects with odd field values, broken and deeply nested JSON, arbitrary bytes,
multipart forms with odd boundaries and part headers) and headers (content types and
encodings, keys, request ids, progress and passed-through headers with bytes outside
ASCII) go to ``/v1/chat/completions``, ``/v1/completions`` and the audio upload route of a
gateway in front of real engine simulators. Each is answered with a clear 4xx (an error
body with a message) or served: never a 5xx, never a hang. Requests are written raw, so
that header bytes arrive as a client sent them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.gateway.conftest import DEADLINE, MODEL_A, Rig, RigFactory

pytestmark = pytest.mark.gateway

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
"""Modest, deterministic (the same examples on every run), no per-example deadline."""

JSON_ROUTES = ["/v1/chat/completions", "/v1/completions"]
FORM_ROUTE = "/v1/audio/transcriptions"


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, each drawn ``weight`` times as often (``one_of`` draws evenly)."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


# -- bodies -----------------------------------------------------------------------------------

odd_text = st.sampled_from(["", " ", "x" * 600, "\ud800", "\x00", "é€", "sim/unknown"])
odd_value = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                      st.floats(allow_nan=True), odd_text, st.just([]), st.just({}))
models = weighted((3, st.just(MODEL_A)), (1, odd_value))
messages = weighted(
    (3, st.just([{"role": "user", "content": "What is 3 + 4?"}])),
    (1, st.lists(st.fixed_dictionaries({}, optional={"role": odd_value,
                                                     "content": odd_value}), max_size=2)),
    (1, odd_value))
prompts = weighted((3, st.just("3 + 4 =")), (1, odd_value))


def request_objects(path: str) -> st.SearchStrategy[dict[str, Any]]:
    """Requests for ``path``: mostly what it needs (``messages`` or ``prompt``), with odd
    values and odd extra fields."""
    needed = {"messages": messages} if path == "/v1/chat/completions" else {"prompt": prompts}
    return weighted((4, st.fixed_dictionaries({"model": models, **needed},
                                              optional=OPTIONAL)),
                    (1, st.fixed_dictionaries({"model": models}, optional={
                        "messages": messages, "prompt": prompts} | OPTIONAL)))


OPTIONAL: dict[str, st.SearchStrategy[Any]] = {
              "stream": weighted((3, st.booleans()), (1, odd_value)),
              "max_tokens": weighted((3, st.integers(1, 4)), (1, st.integers(-2, 0)),
                                     (1, odd_value)),
              "n": weighted((3, st.just(1)), (1, st.integers(-1, 2))),
              "stream_options": weighted((3, st.just({"include_usage": True})),
                                         (1, odd_value)),
              "temperature": weighted((3, st.just(0.0)), (1, st.floats(allow_nan=True)),
                                      (1, odd_value))}


def _nested(depth: int) -> bytes:
    return b'{"model": ' + b"[" * depth + b"]" * depth + b"}"


def json_bodies(path: str) -> st.SearchStrategy[bytes]:
    return weighted(
        (6, request_objects(path).map(lambda obj: json.dumps(obj).encode())),
        (1, request_objects(path).map(lambda obj: json.dumps(obj).encode()[:-1])),  # cut
        (1, st.integers(1, 100_000).map(_nested)),
        (1, st.binary(max_size=64)),
        (1, st.sampled_from([b"", b"null", b"[]", b'"x"', b"\xff\xfe{}",
                             b'{"model": NaN}'])))


json_requests = st.sampled_from(JSON_ROUTES).flatmap(
    lambda path: st.tuples(st.just(path), json_bodies(path)))

boundaries = weighted((3, st.just("XyZ")), (1, st.sampled_from(
    ['"XyZ"', "utf-8''%E2%82%AC", "", "b" * 71, "XyZ "])))
boundary_params = weighted((3, st.just("boundary={}")), (1, st.sampled_from(
    ["boundary*={}", "boundary*0={}; boundary*={}", "BOUNDARY={}"])))
disposition = weighted((3, st.just('form-data; name="model"')), (1, st.sampled_from([
    "form-data; name=model", "form-data; name*=utf-8''model",
    "form-data; name*0=mo; name*=del", 'form-data; name="model"; filename="a.wav"',
    'form-data; name="stream"', "form-data", ""])))
part_values = weighted((3, st.just(MODEL_A.encode())), (1, st.sampled_from([b"true", b""])),
                       (1, st.text(st.characters(codec="utf-8"),
                                   max_size=8).map(str.encode)))
"""Field values (UTF-8: the engine simulator answers 500 to a text field that is not,
where vLLM's form parser falls back to latin-1; a finding about the simulator)."""


@dataclass(frozen=True)
class Form:
    content_type: str
    body: bytes


def _form(boundary: str, param: str, parts: list[tuple[str, bytes]], closed: bool) -> Form:
    raw = boundary.strip('"').encode("utf-8", "replace")
    body = b"".join(b"--" + raw + b"\r\nContent-Disposition: " + head.encode() +
                    b"\r\n\r\n" + value + b"\r\n" for head, value in parts)
    body += b"--" + raw + (b"--\r\n" if closed else b"")
    return Form("multipart/form-data; " + param.format(boundary, boundary), body)


audio = st.just(('form-data; name="file"; filename="a.wav"', b"what is three plus four"))
forms = st.builds(_form, boundaries, boundary_params,
                  st.builds(lambda parts, file: [*parts, *file],
                            st.lists(st.tuples(disposition, part_values), max_size=3),
                            weighted((3, st.tuples(audio)), (1, st.just(())))),
                  weighted((4, st.just(True)), (1, st.just(False))))

# -- headers ----------------------------------------------------------------------------------

header_text = st.one_of(st.sampled_from(["", "reasoning", "none", "é", "€", "\x7f", "\xff"]),
                        st.text(st.characters(blacklist_characters="\r\n",
                                              codec="utf-8"), max_size=12))
odd_headers = st.fixed_dictionaries({}, optional={
    "Authorization": st.sampled_from(["Bearer x", "Basic Zm9v", "", "Bearer é"]),
    "X-Request-Id": header_text, "X-Rota-Progress": header_text, "Accept": header_text,
    "traceparent": header_text, "OpenAI-Organization": header_text,
    "Content-Encoding": st.sampled_from(["gzip", "deflate", "br", "identity", "x-unknown"]),
})
extra_headers = weighted((2, st.just({})), (1, odd_headers))
json_types = st.sampled_from(["application/json", "text/plain", "", "application/json; "
                              "charset=latin-1", "multipart/form-data; boundary=XyZ"])

# -- the raw exchange -------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


def _header_bytes(value: str) -> bytes:
    try:
        return value.encode("latin-1")
    except UnicodeEncodeError:
        return value.encode("utf-8")


def _dechunk(body: bytes) -> bytes:
    out = bytearray()
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line.split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return bytes(out)


async def exchange(rig: Rig, path: str, headers: dict[str, str], body: bytes) -> Answer:
    """One request written byte for byte on its own connection; the whole answer, read
    until the gateway closes it (bounded: a hang fails the test)."""
    port = rig.gateway.port
    assert port is not None
    lines = [f"POST {path} HTTP/1.1".encode(), b"Host: gateway",
             f"Content-Length: {len(body)}".encode(), b"Connection: close",
             *(name.encode() + b": " + _header_bytes(value) for name, value in headers.items())]
    async with asyncio.timeout(DEADLINE):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
            await writer.drain()
            data = await reader.read()
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
    head, _, rest = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    answer_headers = {k.strip().lower(): v.strip() for k, _, v in
                      (line.partition(":") for line in header_lines)}
    if answer_headers.get("transfer-encoding") == "chunked":
        rest = _dechunk(rest)
    return Answer(int(status_line.split(" ", 2)[1]), answer_headers, rest)


def assert_clear(answer: Answer) -> None:
    """Served (200), or refused with a 4xx whose body says why in an error's shape (or,
    for a request HTTP itself forbids, such as a control character in a header, the HTTP
    parser's own plain-text 400, sent before the gateway sees the request)."""
    event(f"status {answer.status}")
    assert answer.status == 200 or 400 <= answer.status < 500, answer
    if answer.status == 400 and answer.headers.get("content-type", "").startswith(
            "text/plain"):
        event("refused by the HTTP parser")
        assert answer.body.strip(), answer
    elif answer.status >= 400:
        error: Any = json.loads(answer.body)["error"]
        message = error["message"] if isinstance(error, dict) else error
        event(f"error {error.get('code') if isinstance(error, dict) else error}")
        assert isinstance(message, str), answer
        assert message, answer


@pytest.fixture
async def rig(make_rig: RigFactory) -> Rig:
    return await make_rig()


@FUZZ
@given(request=json_requests, content_type=json_types, headers=extra_headers)
async def test_every_json_request_is_served_or_clearly_refused(
    rig: Rig, request: tuple[str, bytes], content_type: str, headers: dict[str, str]
) -> None:
    path, body = request
    answer = await exchange(rig, path, {"Content-Type": content_type} | headers, body)
    assert_clear(answer)


@FUZZ
@given(form=forms, headers=extra_headers)
async def test_every_upload_is_served_or_clearly_refused(
    rig: Rig, form: Form, headers: dict[str, str]
) -> None:
    answer = await exchange(rig, FORM_ROUTE, {"Content-Type": form.content_type} | headers,
                            form.body)
    assert_clear(answer)


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_does_not_decode_is_a_400_invalid_body(
    rig: Rig, encoding: str
) -> None:
    """What the fuzzing found: aiohttp decodes the Content-Encoding while the gateway reads
    the body, and a body that does not decode raised out of the handler: a bare 500."""
    body = json.dumps({"model": MODEL_A, "prompt": "3 + 4 ="}).encode()
    answer = await exchange(rig, "/v1/completions",
                            {"Content-Type": "application/json",
                             "Content-Encoding": encoding}, body)
    assert answer.status == 400  # old gateway: 500
    error = json.loads(answer.body)["error"]
    assert (error["code"], error["type"]) == ("invalid_body", "invalid_request_error")
    assert "could not be read" in error["message"]
