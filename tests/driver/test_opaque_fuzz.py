"""Fuzzing the opaque engine config's parser (issue 28): whatever a tenant writes in a
claim's opaque parameters, :func:`rota.api.engine_config.parse_engine_config` returns a valid
config or raises :class:`OpaqueConfigError` with a short message; never another
exception (which would fail a prepare or a routing rebuild in an unplanned place).

The inputs: arbitrary JSON values, and the config's own fields each given an arbitrary
JSON value (so the parser is reached past its apiVersion and kind checks). Example counts
are modest and derandomized: the same inputs on every run.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rota.api.engine_config import API_VERSION, KIND, EngineConfig, parse_engine_config
from rota.api.errors import OpaqueConfigError

FIELDS = ("model", "awakeMemory", "sleepLevel", "enginePort", "adapter", "omniStageIds",
          "http", "apiKeySecret", "probe", "priority", "keepAliveSeconds", "maxWaitSeconds",
          "shareWeight", "home")
"""Every field of ``EngineConfig`` as a tenant writes it."""
MESSAGE_LIMIT = 2048
"""A clear error is short: the parser cuts its message (and quotes little input)."""

LEAVES = (st.none() | st.booleans() | st.integers(min_value=-(2**80), max_value=2**80)
          | st.floats() | st.text(max_size=20)
          | st.sampled_from(["60Gi", "1", "0", "-1Gi", "1e3", "vllm", "vllm-omni", "http",
                             "/sleep", "1.5", "nan", "inf", "9" * 40]))
JSON = st.recursive(LEAVES, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=12) | st.sampled_from(FIELDS), inner,
                                      max_size=4), max_leaves=10)


def _nested(depth: int) -> Any:
    """A list nested ``depth`` levels (built without recursion)."""
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    """A config that names this release's apiVersion and kind, with fields of any shape."""
    config: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "model": "org/m",
                              "awakeMemory": "10Gi"}
    for name in draw(st.sets(st.sampled_from(FIELDS), max_size=5)):
        config[name] = draw(JSON | st.integers(min_value=1, max_value=3).map(
            lambda n: {"x": _nested(n * 40)}))
    if draw(st.booleans()):
        config.update(draw(st.dictionaries(st.text(max_size=12), JSON, max_size=2)))
    return config


def _parses_or_refuses_clearly(parameters: object) -> None:
    try:
        config = parse_engine_config(parameters)
    except OpaqueConfigError as exc:
        message = str(exc)
        assert message.startswith("invalid opaque config for driver gpu.rota.dev")
        assert len(message) <= MESSAGE_LIMIT
        assert "\n" not in message
        return
    assert isinstance(config, EngineConfig)
    assert config.awake_memory > 0
    assert 1 <= config.engine_port <= 65535


FUZZ = settings(max_examples=150, derandomize=True, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])


@FUZZ
@given(JSON)
def test_any_json_value_parses_or_is_refused_clearly(parameters: object) -> None:
    _parses_or_refuses_clearly(parameters)


@FUZZ
@given(configs())
def test_any_field_value_parses_or_is_refused_clearly(parameters: dict[str, Any]) -> None:
    _parses_or_refuses_clearly(parameters)
