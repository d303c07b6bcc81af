"""The engine sections of the opaque config: the engine's API key Secret, the probe, and
what vLLM-Omni cannot do (refused at prepare, with a message that says why)."""

from __future__ import annotations

from typing import Any

import pytest

from rota.api.engine_config import (
    DEFAULT_PROBE_ANSWER,
    DEFAULT_PROBE_MAX_TOKENS,
    DEFAULT_PROBE_PROMPT,
    parse_engine_config,
)
from rota.api.errors import OpaqueConfigError


def params(**extra: Any) -> dict[str, Any]:
    return {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
            "model": "org/model", "awakeMemory": "20Gi"} | extra


def test_omni_at_level_2_is_refused_with_the_reason() -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(params(adapter="vllm-omni", omniStageIds=[0, 1, 2], sleepLevel=2))
    message = str(caught.value)
    assert "sleepLevel 2 is not supported for adapter vllm-omni" in message
    assert "501" in message
    assert "use sleepLevel 1" in message


def test_omni_needs_its_stage_ids() -> None:
    with pytest.raises(OpaqueConfigError, match="adapter vllm-omni needs omniStageIds"):
        parse_engine_config(params(adapter="vllm-omni"))
    config = parse_engine_config(params(adapter="vllm-omni", omniStageIds=[0, 1, 2]))
    assert (config.sleep_level, config.omni_stage_ids) == (1, (0, 1, 2))


def test_level_2_stays_fine_for_vllm() -> None:
    assert parse_engine_config(params(sleepLevel=2)).sleep_level == 2


def test_api_key_secret_defaults_its_key() -> None:
    config = parse_engine_config(params(apiKeySecret={"name": "engine-a-key"}))
    assert config.api_key_secret is not None
    assert (config.api_key_secret.name, config.api_key_secret.key) == ("engine-a-key",
                                                                       "api-key")
    other = parse_engine_config(params(apiKeySecret={"name": "k", "key": "token.txt"}))
    assert other.api_key_secret is not None
    assert other.api_key_secret.key == "token.txt"


@pytest.mark.parametrize(("secret", "problem"), [
    ({}, "apiKeySecret.name: required field is missing"),
    ({"name": "Not_A_Name"}, "apiKeySecret.name: must be a Secret name"),
    ({"name": "ok", "key": "a/b"}, "apiKeySecret.key: must be a Secret key"),
    ({"name": "ok", "value": "s3cret"}, "apiKeySecret.value: unknown field"),
])
def test_bad_api_key_secret(secret: dict[str, str], problem: str) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(params(apiKeySecret=secret))
    assert problem in str(caught.value)


def test_probe_defaults_are_the_reference_question() -> None:
    config = parse_engine_config(params(probe={}))
    assert config.probe is not None
    assert (config.probe.mode, config.probe.prompt, config.probe.expect,
            config.probe.max_tokens, config.probe.reasoning_counts) == (
        "answer", DEFAULT_PROBE_PROMPT, DEFAULT_PROBE_ANSWER, DEFAULT_PROBE_MAX_TOKENS, False)
    assert parse_engine_config(params()).probe is None


def test_probe_for_a_reasoning_model() -> None:
    config = parse_engine_config(params(probe={
        "prompt": "Name the capital of France in one word.", "expect": "Paris",
        "maxTokens": 512, "reasoningCounts": True,
        "chatTemplateKwargs": {"enable_thinking": False}}))
    assert config.probe is not None
    assert config.probe.expect == "Paris"
    assert config.probe.max_tokens == 512
    assert config.probe.reasoning_counts
    assert config.probe.chat_template_kwargs == {"enable_thinking": False}


@pytest.mark.parametrize(("probe", "problem"), [
    ({"mode": "vibes"}, "probe.mode: Input should be 'answer' or 'structure'"),
    ({"maxTokens": 0}, "probe.maxTokens: Input should be greater than or equal to 1"),
    ({"maxTokens": "8"}, "probe.maxTokens: Input should be a valid integer"),
    ({"expect": "   "}, "probe.expect: must not be blank"),
    ({"prompt": ""}, "probe.prompt: String should have at least 1 character"),
    ({"answer": "7"}, "probe.answer: unknown field"),
])
def test_bad_probe(probe: dict[str, Any], problem: str) -> None:
    with pytest.raises(OpaqueConfigError) as caught:
        parse_engine_config(params(probe=probe))
    assert problem in str(caught.value)
