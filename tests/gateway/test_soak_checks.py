"""The soak's judgement of an answer (:func:`e2e.campaigns.soak.check_answer`): a 200 is a good
answer only when it is whole and of the model asked for; a stream that breaks the SSE format is
malformed."""

from __future__ import annotations

import json
from typing import Any

import pytest

from e2e.campaigns.soak import check_answer
from e2e.harness.wire import Malformed

pytestmark = pytest.mark.gateway

MODEL = "org/soak-a"


def _stream(*chunks: dict[str, Any], done: bool = True) -> bytes:
    events = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return "".join([*events, "data: [DONE]\n\n" if done else ""]).encode()


def _delta(text: str, model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "choices": [{"index": 0, "delta": {"content": text}}]}


USAGE = {"model": MODEL, "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}


def test_a_whole_stream_and_a_whole_answer_pass() -> None:
    assert check_answer("chat-stream", MODEL, _stream(_delta("7"), USAGE)) == ""
    answer = {"model": MODEL, "choices": [{"index": 0, "message": {"content": "7"}}]}
    assert check_answer("chat", MODEL, json.dumps(answer).encode()) == ""


@pytest.mark.parametrize(("body", "problem"), [
    (_stream(_delta("7"), USAGE, done=False), "without [DONE]"),
    (_stream(_delta("7"), {"error": {"message": "lost", "code": "lost_gpu"}}),
     "ended in an error"),
    (_stream(USAGE), "without content"),
    (_stream(_delta("7")), "without its usage"),
    (_stream(_delta("7", model="org/other"), USAGE), "another model"),
])
def test_a_stream_that_is_not_whole_fails(body: bytes, problem: str) -> None:
    assert problem in check_answer("chat-stream", MODEL, body)


def test_an_answer_of_another_model_fails() -> None:
    answer = {"model": "org/other", "choices": [{"index": 0, "text": "7"}]}
    assert "without choices of" in check_answer("completion", MODEL, json.dumps(answer).encode())


def test_a_broken_stream_is_malformed() -> None:
    with pytest.raises(Malformed):
        check_answer("chat-stream", MODEL, b"data: {}\nHTTP/1.1 503 Service Unavailable\n\n")
