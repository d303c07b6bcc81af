"""``keepRequests`` in a claim, and what takes effect (:func:`keeps_requests`): kept by
default only where keeping was shown on real engines (vLLM at level 1, one GPU)."""

from __future__ import annotations

from typing import Any

import pytest

from rota.api.engine_config import API_VERSION, KIND, keeps_requests, parse_engine_config
from rota.api.errors import OpaqueConfigError


def _config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "model": "m", "awakeMemory": "8Gi",
            **fields}


@pytest.mark.parametrize(("fields", "gang", "kept"), [
    ({}, False, True),
    ({"keepRequests": False}, False, False),
    ({"sleepLevel": 2}, False, False),
    ({"adapter": "http"}, False, False),
    ({"adapter": "http", "keepRequests": True}, False, True),
    ({"adapter": "vllm-omni", "omniStageIds": [0, 1]}, False, False),
    ({}, True, False),
    ({"keepRequests": True}, True, False),
])
def test_what_takes_effect(fields: dict[str, Any], gang: bool, kept: bool) -> None:
    assert keeps_requests(parse_engine_config(_config(**fields)), gang=gang) is kept


@pytest.mark.parametrize(("fields", "why"), [
    ({"sleepLevel": 2, "keepRequests": True}, "sleepLevel 2"),
    ({"adapter": "vllm-omni", "omniStageIds": [0], "keepRequests": True}, "vllm-omni"),
])
def test_keeping_where_not_shown_safe_is_refused_with_the_reason(
        fields: dict[str, Any], why: str) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(_config(**fields))
    assert "keepRequests" in str(caught.value)
    assert why in str(caught.value)


def test_the_json_name_is_camel_case() -> None:
    config = parse_engine_config(_config(keepRequests=False))
    assert config.keep_requests is False
    assert config.to_parameters()["keepRequests"] is False
    with pytest.raises(OpaqueConfigError):
        parse_engine_config(_config(keep_requests=True))
