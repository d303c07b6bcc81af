"""The gpu.rota.dev opaque claim config: defaults, field rules and error messages."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from rota.api.engine_config import EngineConfig, HttpAdapterConfig, parse_engine_config
from rota.api.errors import OpaqueConfigError


def params(**fields: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "apiVersion": "gpu.rota.dev/v1alpha1",
        "kind": "EngineConfig",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "awakeMemory": "60Gi",
    }
    base.update(fields)
    return {key: value for key, value in base.items() if value is not None}


def test_minimal_config_takes_defaults() -> None:
    config = parse_engine_config(params())
    assert config.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert config.awake_memory == 60 * 2**30
    assert config.sleep_level == 1
    assert config.engine_port == 8000
    assert config.adapter == "vllm"
    assert config.omni_stage_ids is None
    assert config.http is None


@pytest.mark.parametrize(
    ("fields", "attribute", "expected"),
    [
        ({"awakeMemory": 64424509440}, "awake_memory", 64424509440),
        ({"awakeMemory": 6.4e10}, "awake_memory", 64_000_000_000),
        ({"awakeMemory": "1.5Gi"}, "awake_memory", 3 * 2**29),
        ({"sleepLevel": 2}, "sleep_level", 2),
        ({"enginePort": 1}, "engine_port", 1),
        ({"enginePort": 65535}, "engine_port", 65535),
        ({"adapter": "http"}, "adapter", "http"),
        ({"adapter": "vllm-omni", "omniStageIds": [0, 2]}, "omni_stage_ids", (0, 2)),
        (
            {"adapter": "http", "http": {"sleepPath": "/v1/sleep?level=1"}},
            "http",
            HttpAdapterConfig(sleep_path="/v1/sleep?level=1"),
        ),
        ({"model": "m" * 253}, "model", "m" * 253),
    ],
)
def test_valid_fields(fields: dict[str, Any], attribute: str, expected: object) -> None:
    assert getattr(parse_engine_config(params(**fields)), attribute) == expected


def test_http_block_defaults_to_vllm_paths() -> None:
    config = parse_engine_config(params(adapter="http", http={}))
    assert config.http == HttpAdapterConfig()
    assert config.http.sleep_path == "/sleep"
    assert config.http.wake_path == "/wake_up"
    assert config.http.is_sleeping_path == "/is_sleeping"


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"model": None}, "model: required field is missing"),
        ({"model": ""}, "model: String should have at least 1 character"),
        ({"model": "m" * 254}, "model: String should have at most 253 characters"),
        ({"model": " llama"}, "model: must not have surrounding whitespace"),
        ({"model": "llama\n"}, "model: must not have surrounding whitespace"),
        ({"model": 7}, "model: Input should be a valid string"),
        ({"awakeMemory": None}, "awakeMemory: required field is missing"),
        ({"awakeMemory": "0"}, "awakeMemory: Input should be greater than 0"),
        ({"awakeMemory": "-1Gi"}, "awakeMemory: invalid quantity '-1Gi': must not be negative"),
        ({"awakeMemory": "lots"}, "awakeMemory: invalid quantity 'lots'"),
        ({"awakeMemory": True}, "awakeMemory: must be a quantity"),
        ({"awakeMemory": [1]}, "awakeMemory: must be a quantity"),
        ({"awakeMemory": 1.5}, "awakeMemory: must be a quantity"),
        ({"sleepLevel": 3}, "sleepLevel: Input should be 1 or 2"),
        ({"sleepLevel": "1"}, "sleepLevel: must be the number 1 or 2"),
        ({"sleepLevel": True}, "sleepLevel: must be the number 1 or 2"),
        ({"enginePort": 0}, "enginePort: Input should be greater than or equal to 1"),
        ({"enginePort": 65536}, "enginePort: Input should be less than or equal to 65535"),
        ({"enginePort": "8000"}, "enginePort: Input should be a valid integer"),
        ({"adapter": "sglang"}, "adapter: Input should be 'vllm', 'vllm-omni' or 'http'"),
        ({"omniStageIds": [1]}, "omniStageIds applies only to adapter vllm-omni, not vllm"),
        (
            {"adapter": "vllm-omni", "omniStageIds": []},
            "omniStageIds: must list at least one stage id",
        ),
        (
            {"adapter": "vllm-omni", "omniStageIds": [-1]},
            "omniStageIds.0: Input should be greater than or equal to 0",
        ),
        ({"adapter": "vllm-omni", "omniStageIds": [1, 1]}, "omniStageIds: stage ids must not"),
        ({"adapter": "vllm-omni", "omniStageIds": ["1"]}, "omniStageIds.0: Input should be"),
        ({"http": {}}, "http applies only to adapter http, not vllm"),
        ({"adapter": "http", "http": {"wakePath": "wake"}}, "http.wakePath: must be an absolute"),
        (
            {"adapter": "http", "http": {"wakePath": "//evil.example/wake"}},
            "http.wakePath: must be an absolute",
        ),
        (
            {"adapter": "http", "http": {"sleepPath": "http://evil/"}},
            "http.sleepPath: must be an absolute",
        ),
        ({"adapter": "http", "http": {"port": 1}}, "http.port: unknown field"),
        ({"awake_memory": "1Gi"}, "awake_memory: unknown field"),
        ({"adapter": "http", "http": {"sleep_path": "/s"}}, "http.sleep_path: unknown field"),
        ({"extra": 1}, "extra: unknown field"),
    ],
)
def test_invalid_fields_are_named(fields: dict[str, Any], fragment: str) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(params(**fields))
    message = str(caught.value)
    assert message.startswith("invalid opaque config for driver gpu.rota.dev: ")
    assert fragment in message
    assert caught.value.reason == "invalid_config"
    assert caught.value.permanent


def test_every_bad_field_is_reported_in_one_line() -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(params(model="", sleepLevel=5, enginePort=0))
    message = str(caught.value)
    assert "\n" not in message
    for field in ("model:", "sleepLevel:", "enginePort:"):
        assert field in message


@pytest.mark.parametrize(
    ("parameters", "fragment"),
    [
        (params(apiVersion="gpu.rota.dev/v9"), "unsupported apiVersion 'gpu.rota.dev/v9'"),
        (params(apiVersion=None), "unsupported apiVersion none"),
        (params(apiVersion=3), "unsupported apiVersion 3"),
        (params(kind="GpuConfig"), "unsupported kind 'GpuConfig' in gpu.rota.dev/v1alpha1"),
        (params(kind=None), "unsupported kind none"),
    ],
)
def test_unknown_version_or_kind_lists_what_is_supported(
    parameters: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(parameters)
    assert fragment in str(caught.value)
    assert "EngineConfig" in str(caught.value).split("supported:")[-1]


@pytest.mark.parametrize("parameters", [None, [], "EngineConfig", 3])
def test_parameters_must_be_an_object(parameters: object) -> None:
    with pytest.raises(OpaqueConfigError, match="must be a JSON object"):
        parse_engine_config(parameters)


@pytest.mark.parametrize(
    "parameters",
    [
        params(**{"k" * 5000: 1}),
        params(apiVersion="v" * 5000),
        params(kind="k" * 5000),
        params(awakeMemory="9" * 5000),
        params(model="m" * 5000, adapter="a" * 5000, http={"x" * 5000: 1}),
    ],
)
def test_messages_quote_little_user_input(parameters: dict[str, Any]) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(parameters)
    message = str(caught.value)
    assert len(message) <= 1100
    for char in "kvm9ax":
        assert char * 257 not in message


def test_to_parameters_round_trips() -> None:
    config = parse_engine_config(
        params(adapter="vllm-omni", omniStageIds=[0, 1], enginePort=9000,
               apiKeySecret={"name": "engine-key"},
               probe={"mode": "structure", "maxTokens": 64})
    )
    parameters = config.to_parameters()
    assert parameters == {
        "apiVersion": "gpu.rota.dev/v1alpha1",
        "kind": "EngineConfig",
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "awakeMemory": 60 * 2**30,
        "enginePort": 9000,
        "adapter": "vllm-omni",
        "omniStageIds": [0, 1],
        "apiKeySecret": {"name": "engine-key"},
        "probe": {"mode": "structure", "maxTokens": 64},
    }
    assert parse_engine_config(parameters) == config


def test_config_is_frozen() -> None:
    config = parse_engine_config(params())
    assert isinstance(config, EngineConfig)
    with pytest.raises(ValueError, match="frozen"):
        config.model = "other"


def test_importable_without_grpc_or_kubernetes() -> None:
    code = (
        "import sys, rota.api.engine_config; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('grpc', 'kubernetes')); "
        "print(','.join(bad)); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
