"""The activation API takes its bearer token in ``Authorization`` (gateways) or in
``X-Rota-Activation-Token``: the API server's pod proxy, which ``kubectl rota`` goes
through, authenticates the caller with ``Authorization`` and drops it before forwarding.
Both headers are checked against every line of the token file; nothing else passes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
from aiohttp.test_utils import TestClient, TestServer

from controller.credentials import ApiKeys, SecretFile
from controller.lease.activation import make_app
from controller.lease.node import NodeController
from rota.api.activation import TOKEN_HEADER

TOKEN, ROTATED = "a1b2c3d4e5f6a7b8c9d0e1f2a3b4c5d6", "f0e1d2c3b4a5968778695a4b3c2d1e0f"


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[TestClient[Any, Any]]:
    path = tmp_path / "token"
    path.write_text(f"{TOKEN}\n{ROTATED}\n")
    callers = SecretFile(path)
    await callers.load()
    # No route below /v1 but the contract's is reached with an unknown path: an admitted
    # call is a 404 from routing, a refused one the middleware's 401. No node is needed.
    app = make_app(cast(NodeController, None), callers=ApiKeys(callers))
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1", port=0))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


@pytest.mark.parametrize(("headers", "status"), [
    ({}, 401),
    ({"Authorization": f"Bearer {TOKEN}"}, 404),
    ({"Authorization": f"Bearer {ROTATED}"}, 404),
    ({"Authorization": "Bearer wrong"}, 401),
    ({TOKEN_HEADER: TOKEN}, 404),
    ({TOKEN_HEADER: ROTATED}, 404),
    ({TOKEN_HEADER: "wrong"}, 401),
    ({TOKEN_HEADER: f"Bearer {TOKEN}"}, 401),
    ({TOKEN_HEADER: ""}, 401),
    ({"Authorization": "Bearer wrong", TOKEN_HEADER: TOKEN}, 404),
], ids=["none", "bearer", "bearer-rotated", "bearer-wrong", "header", "header-rotated",
        "header-wrong", "header-with-scheme", "header-empty", "wrong-bearer-right-header"])
async def test_the_token_is_taken_from_either_header(api: TestClient[Any, Any],
                                                     headers: dict[str, str],
                                                     status: int) -> None:
    answer = await api.get("/v1/not-a-route", headers=headers)
    assert answer.status == status, await answer.text()
