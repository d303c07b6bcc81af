"""The start-gate API answers every question in its documented shape, :class:`StartReply`,
a body over its limit included (review R13: aiohttp's plain-text 413 before)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.lease.node import NodeController, StartAnswer
from controller.lease.starts import PATH, StartReply, make_app

pytestmark = pytest.mark.controller


@dataclass
class _Node:
    asked: list[str] = field(default_factory=list)

    async def request_start(self, claim_uid: str, token: str) -> StartAnswer:
        self.asked.append(claim_uid)
        return StartAnswer(granted=True)


@pytest.fixture
async def node() -> _Node:
    return _Node()


@pytest.fixture
async def api(node: _Node) -> AsyncIterator[TestClient[Any, Any]]:
    client: TestClient[Any, Any] = TestClient(TestServer(
        make_app(cast(NodeController, node)), host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@pytest.mark.parametrize("size", [4096, 64 * 1024])
async def test_an_oversized_question_gets_a_start_reply(api: TestClient[Any, Any],
                                                        node: _Node, size: int) -> None:
    body = b'{"claim_uid": "u", "token": "' + b"t" * size + b'"}'
    async with api.post(PATH, data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 413
        assert resp.content_type == "application/json", await resp.text()
        reply = StartReply.model_validate(await resp.json())
    assert not reply.granted
    assert reply.reason == "request_too_large"
    assert reply.message
    assert node.asked == []


async def test_a_question_under_the_limit_is_answered(api: TestClient[Any, Any],
                                                      node: _Node) -> None:
    body = b'{"claim_uid": "u", "token": "t"}' + b" " * 3000
    async with api.post(PATH, data=body, headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == 200
        assert StartReply.model_validate(await resp.json()).granted
    assert node.asked == ["u"]
