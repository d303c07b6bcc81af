"""Property-based tests of the lease controller's two HTTP boundaries (issue 28).

- The activation API (``POST /v1/activate``, :mod:`controller.lease.activation`): every
  body and token is answered by the contract's table, an
  :class:`~rota.api.activation.ErrorBody` whose code decides the status, or an
  :class:`~rota.api.activation.ActivateAnswer`; never a 5xx of its own.
- The start gate (``POST /v1/start``, :mod:`controller.lease.starts`, contract
  :mod:`rota.api.start_contract`): every body is answered with a
  :class:`~controller.lease.starts.StartReply` and a 200, 400, 401 or 413.

Neither node behind them is the real one: each fake answers as the real one does for the
inputs it is given (an unknown model, a token that is not the claim's), so what is tested
is the boundary's reading of bytes. Deterministic, modest example counts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from controller.credentials import ApiKeys, SecretFile
from controller.lease.activation import make_app as activation_app
from controller.lease.gpu import Activation
from controller.lease.node import NodeController, StartAnswer, UnknownModel
from controller.lease.starts import PATH as START_PATH
from controller.lease.starts import StartReply
from controller.lease.starts import make_app as start_app
from rota.api.activation import (
    PATH,
    TOKEN_HEADER,
    ActivateAnswer,
    ErrorBody,
    refusal_of,
)
from tests.controller.activation_kit import CLAIM, MODEL, claimant_b

pytestmark = pytest.mark.controller

FUZZ = settings(max_examples=150, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])
"""Modest, deterministic (the same examples on every run), no per-example deadline."""

TOKEN = "activation-secret"
START_TOKEN = "start-token-of-uid-b"


def weighted(*choices: tuple[int, st.SearchStrategy[Any]]) -> st.SearchStrategy[Any]:
    """One of ``choices``, each drawn ``weight`` times as often."""
    pool = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.sampled_from(pool).flatmap(lambda strategy: strategy)


odd = st.one_of(st.none(), st.booleans(), st.integers(-(2**80), 2**80),
                st.floats(allow_nan=True), st.text(max_size=8), st.just([]), st.just({}),
                st.sampled_from(["", "x" * 600, "\ud800", "\x00", "é€"]))


def bodies(objects: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[bytes]:
    """JSON of ``objects`` (whole, cut short), deep nesting, arbitrary bytes, big ones."""
    return weighted(
        (6, objects.map(lambda obj: json.dumps(obj).encode())),
        (1, objects.map(lambda obj: json.dumps(obj).encode()[:-1])),
        (1, st.integers(1, 50_000).map(lambda depth: b"[" * depth + b"]" * depth)),
        (1, st.binary(max_size=64)),
        (1, st.sampled_from([b"", b"null", b"[]", b'"x"', b"\xff{}", b'{"model": NaN}',
                             b'{"model": "' + b"m" * 70_000 + b'"}'])))


def headers(token: str) -> st.SearchStrategy[dict[str, str]]:
    """Mostly the right token, as a bearer or in the token header; at times a wrong one."""
    tokens = st.sampled_from([token, "", "wrong", "Bearer", "Bearer  x", " " * 3])
    right = st.sampled_from([{"Authorization": f"Bearer {token}"}, {TOKEN_HEADER: token}])
    others = st.fixed_dictionaries({}, optional={
        "Authorization": st.builds(lambda t: f"Bearer {t}", tokens) | tokens,
        TOKEN_HEADER: tokens,
        "Content-Type": st.sampled_from(["application/json", "text/plain", ""]),
        "Content-Encoding": st.sampled_from(["identity", "gzip"]),
    })
    return st.builds(lambda auth, rest: auth | rest,
                     weighted((3, right), (1, st.just({}))), others)


# -- the activation API -----------------------------------------------------------------------


@dataclass
class ActivationNodeFake:
    """Answers an activation as the node does: UnknownModel for anything but the one
    claimant's model (and claim), else that claimant, already awake."""

    asked: list[tuple[str, str | None]] = field(default_factory=list)

    async def activate(self, model: str, claim: str | None = None) -> Activation:
        self.asked.append((model, claim))
        if model != MODEL or claim not in (None, CLAIM):
            raise UnknownModel(f"no serving claimant for model {model!r} on node node-a")
        return Activation(True, claimant_b(), switched=False, fence=3)


activation_objects = st.fixed_dictionaries(
    {"model": weighted((3, st.just(MODEL)), (1, odd))},
    optional={"claim": weighted((3, st.sampled_from([CLAIM, None])), (1, odd)),
              "extra": odd})


@pytest.fixture
async def activation_api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    (tmp_path / "token").write_text(TOKEN + "\n")
    secret = SecretFile(tmp_path / "token")
    await secret.load()
    app = activation_app(cast(NodeController, ActivationNodeFake()), callers=ApiKeys(secret))
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@FUZZ
@given(body=bodies(activation_objects), sent=headers(TOKEN))
async def test_every_activation_is_answered_by_the_contract(
    activation_api: TestClient[Any, Any], body: bytes, sent: dict[str, str]
) -> None:
    async with activation_api.post(PATH, data=body, headers=sent) as resp:
        raw = await resp.read()
        status = resp.status
    event(f"status {status}")
    assert status < 500, raw[:300]
    if status == 200:
        ActivateAnswer.model_validate_json(raw)
        return
    error = ErrorBody.model_validate_json(raw).error
    event(f"code {error.type}")
    assert refusal_of(error.type).status == status, error
    assert error.message


# -- the start gate ---------------------------------------------------------------------------


@dataclass
class StartNodeFake:
    """Answers a start as the node does for a token: 401 unless it is the claim's."""

    asked: list[str] = field(default_factory=list)

    async def request_start(self, claim_uid: str, token: str) -> StartAnswer:
        self.asked.append(claim_uid)
        if token != START_TOKEN:
            return StartAnswer(status=401, reason="unauthorized",
                               message="the start token is not this claim's")
        return StartAnswer(granted=True)


start_objects = st.fixed_dictionaries(
    {"claim_uid": weighted((3, st.just("uid-b")), (1, odd)),
     "token": weighted((3, st.sampled_from([START_TOKEN, "x"])), (1, odd))},
    optional={"attempt": weighted((3, st.integers(0, 5)), (1, odd)), "extra": odd})


@pytest.fixture
async def start_api() -> AsyncIterator[TestClient[Any, Any]]:
    client: TestClient[Any, Any] = TestClient(TestServer(
        start_app(cast(NodeController, StartNodeFake())), host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@FUZZ
@given(body=bodies(start_objects), sent=headers(START_TOKEN))
async def test_every_start_question_gets_a_start_reply(
    start_api: TestClient[Any, Any], body: bytes, sent: dict[str, str]
) -> None:
    async with start_api.post(START_PATH, data=body, headers=sent) as resp:
        raw = await resp.read()
        status = resp.status
    event(f"status {status}")
    assert status in (200, 400, 401, 413), (status, raw[:300])
    reply = StartReply.model_validate_json(raw)
    event(f"reason {reply.reason or 'granted'}")
    assert reply.granted == (status == 200 and reply.reason == ""), reply
    if not reply.granted:
        assert reply.reason
        assert reply.message


# -- what the fuzzing found: a body that does not decode ------------------------------------

UNDECODABLE = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
"""A body sent as gzip that is not: aiohttp decodes while the handler reads and raises
RequestPayloadError (ContentEncodingError) out of it, which aiohttp answers with a bare
plain-text 500 unless the handler answers it (both now do: 400 invalid_request)."""


async def test_an_activation_body_that_does_not_decode_is_invalid_request(
    activation_api: TestClient[Any, Any]
) -> None:
    body = json.dumps({"model": MODEL}).encode()
    async with activation_api.post(PATH, data=body, headers=UNDECODABLE | {
            "Authorization": f"Bearer {TOKEN}"}) as resp:
        assert resp.status == 400, await resp.text()
        assert ErrorBody.model_validate_json(await resp.read()).error.type == "invalid_request"


async def test_a_start_question_that_does_not_decode_is_invalid_request(
    start_api: TestClient[Any, Any]
) -> None:
    body = json.dumps({"claim_uid": "uid-b", "token": START_TOKEN}).encode()
    async with start_api.post(START_PATH, data=body, headers=UNDECODABLE) as resp:
        assert resp.status == 400, await resp.text()
        assert StartReply.model_validate_json(await resp.read()).reason == "invalid_request"
