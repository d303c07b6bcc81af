"""The opaque claim configuration users give to the ``gpu.rota.dev`` driver.

A ResourceClaim says how much GPU memory its engine holds all the time (the consumed
``memory`` capacity, its footprint asleep). What the engine needs while it is awake, and how
to put it to sleep and wake it, cannot be said in capacity terms, so it travels as opaque
parameters for this driver::

    config:
    - opaque:
        driver: gpu.rota.dev
        parameters:
          apiVersion: gpu.rota.dev/v1alpha1
          kind: EngineConfig
          model: meta-llama/Llama-3.1-8B-Instruct
          awakeMemory: 60Gi
          sleepLevel: 1
          enginePort: 8000
          adapter: vllm

The driver checks the awake budget at prepare; the lease controller reads the same model to
find each claimant's engine. This module therefore depends only on pydantic and the quantity
parser: it must stay importable without grpc or the kubernetes client.

``awakeMemory`` is what the engine holds on one GPU while awake, its resident part included.

Optional sections:

- ``apiKeySecret: {name, key}``: the Secret (in the claim's namespace; ``key`` defaults to
  ``api-key``) holding the engine's own API key (vLLM's ``--api-key``). The lease
  controller's probe and the gateway send it as ``Authorization: Bearer`` on ``/v1*``.
- ``probe``: how the correctness probe after every wake asks and judges (prompt, expected
  answer, token budget, ``reasoning_content``, or ``mode: structure`` for models whose
  answer cannot be predicted).
- ``omniStageIds`` (required for ``adapter: vllm-omni``): the pipeline's stages.
- Switch policy (``controller/lease/policy.py``): ``priority``, ``keepAliveSeconds``,
  ``maxWaitSeconds``, ``shareWeight``, ``home``, and the service objectives
  ``firstTokenSeconds`` and ``longestFreezeSeconds``; each absent field takes the lease
  controller's node-wide default. Each buys GPU time, so the lease controller holds each,
  set or not, to what the admin allows the claim's namespace
  (``controller/lease/tenants.py``) before its policy reads it; the ranges here only
  check the values are meaningful.

- ``keepRequests``: whether a switch may freeze the engine's requests in flight (sleep
  with them kept, continued at its next wake) instead of draining it; absent, rota decides
  (:func:`keeps_requests`).

``adapter: vllm-omni`` takes ``sleepLevel: 1`` only: vLLM-Omni 0.26 and 0.30 cannot wake
after a level-2 sleep (501, and the engine stays asleep until restarted).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from rota.api.errors import OpaqueConfigError
from rota.api.quantity import parse_quantity

__all__ = [
    "API_GROUP",
    "API_VERSION",
    "DEFAULT_FIRST_TOKEN_SECONDS",
    "DEFAULT_LONGEST_FREEZE_SECONDS",
    "DEFAULT_PROBE_ANSWER",
    "DEFAULT_PROBE_MAX_TOKENS",
    "DEFAULT_PROBE_PROMPT",
    "KIND",
    "SUPPORTED",
    "Adapter",
    "EngineConfig",
    "HttpAdapterConfig",
    "ProbeConfig",
    "SecretKeyRef",
    "keeps_requests",
    "parse_engine_config",
]

API_GROUP = "gpu.rota.dev"
API_VERSION = f"{API_GROUP}/v1alpha1"
KIND = "EngineConfig"
SUPPORTED: Mapping[str, tuple[str, ...]] = {API_VERSION: (KIND,)}
"""Every apiVersion this release reads, with the kinds it knows in each."""

Adapter = Literal["vllm", "vllm-omni", "http"]

_MAX_MESSAGE_CHARS = 1024
_MAX_SHOWN_INPUT = 40
_MAX_STAGE_IDS = 64
_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]{0,255}")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")

DEFAULT_PROBE_PROMPT = "What is 3 + 4? Answer with a single number."
DEFAULT_PROBE_ANSWER = "7"
DEFAULT_PROBE_MAX_TOKENS = 8
DEFAULT_FIRST_TOKEN_SECONDS = 2.0
"""A request's first-token objective where neither the claim nor the node says one."""
DEFAULT_LONGEST_FREEZE_SECONDS = 3.0
"""The longest freeze a started stream may suffer where neither the claim nor the node
says one: the lease controller's policy and the gateway's read timeouts both start here."""


class _Model(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        alias_generator=to_camel,
        validate_by_alias=True,
        validate_by_name=True,
    )


class HttpAdapterConfig(_Model):
    """How the generic HTTP adapter reaches an engine's sleep controls.

    Each value is a path on the engine's port (``enginePort``), never a URL: the controller
    only ever talks to the claimant's own pod.
    """

    sleep_path: str = "/sleep"
    """POST here to put the engine to sleep."""
    wake_path: str = "/wake_up"
    """POST here to wake the engine."""
    is_sleeping_path: str = "/is_sleeping"
    """GET here; the answer is JSON ``{"is_sleeping": bool}``."""

    @field_validator("sleep_path", "wake_path", "is_sleeping_path")
    @classmethod
    def _check_path(cls, value: str) -> str:
        if not _PATH.fullmatch(value) or value.startswith("//"):
            raise ValueError(
                "must be an absolute path such as /sleep (at most 256 URL-safe characters, "
                "no scheme or host)"
            )
        return value


class SecretKeyRef(_Model):
    """One key of a Secret in the claim's namespace."""

    name: str = Field(min_length=1, max_length=253)
    """The Secret's name."""
    key: str = Field(default="api-key", min_length=1, max_length=253)
    """The key inside the Secret whose value is the engine's API key."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _DNS_SUBDOMAIN.fullmatch(value):
            raise ValueError("must be a Secret name (a DNS subdomain: lower case, digits, "
                             "'-' and '.')")
        return value

    @field_validator("key")
    @classmethod
    def _check_key(cls, value: str) -> str:
        if not _SECRET_KEY.fullmatch(value):
            raise ValueError("must be a Secret key (letters, digits, '-', '_' and '.')")
        return value


class ProbeConfig(_Model):
    """How the correctness probe after every wake asks and judges the engine.

    ``mode: answer`` (default) asks ``prompt`` and accepts only ``expect`` (surrounding
    whitespace and trailing punctuation allowed). ``mode: structure`` accepts any
    non-empty content and checks only the stream's structure (``[DONE]``, a usage block):
    for models whose answer cannot be predicted; the controller says so in the Lease and
    its metrics.
    """

    mode: Literal["answer", "structure"] = "answer"
    prompt: str = Field(default=DEFAULT_PROBE_PROMPT, min_length=1, max_length=4096)
    """The user message of the probe."""
    expect: str = Field(default=DEFAULT_PROBE_ANSWER, min_length=1, max_length=256)
    """The answer ``mode: answer`` accepts."""
    max_tokens: int = Field(default=DEFAULT_PROBE_MAX_TOKENS, ge=1, le=4096, strict=True)
    """The probe's token budget (a reasoning model may need hundreds)."""
    reasoning_counts: bool = False
    """Count the stream's ``reasoning_content`` (``reasoning``) with its ``content``: for
    reasoning models served with a reasoning parser, whose first tokens are thoughts."""
    chat_template_kwargs: dict[str, str | int | float | bool] | None = None
    """Sent as is in the request (e.g. ``{"enable_thinking": false}`` for Qwen3)."""

    @field_validator("prompt", "expect")
    @classmethod
    def _check_text(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value


class EngineConfig(_Model):
    """``gpu.rota.dev/v1alpha1`` ``EngineConfig``: one engine's budgets and controls."""

    api_version: Literal["gpu.rota.dev/v1alpha1"]
    kind: Literal["EngineConfig"]
    model: str = Field(min_length=1, max_length=253)
    """The served model name the gateway routes by (``/v1/models`` id)."""
    awake_memory: int = Field(gt=0)
    """Bytes the engine holds on its GPU while awake, resident part included."""
    sleep_level: Literal[1, 2] = 1
    """vLLM sleep level: 1 offloads weights to host memory, 2 discards them."""
    engine_port: int = Field(default=8000, ge=1, le=65535, strict=True)
    """The engine's HTTP port inside the pod (OpenAI API and sleep controls)."""
    adapter: Adapter = "vllm"
    """How the lease controller drives the engine."""
    omni_stage_ids: tuple[Annotated[int, Field(strict=True, ge=0)], ...] | None = None
    """vLLM-Omni only, and required there: the stages to put to sleep and wake (vLLM-Omni
    has no call that lists its stages; Qwen2.5-Omni and Qwen3-Omni have 0, 1 and 2)."""
    http: HttpAdapterConfig | None = None
    """Generic HTTP adapter only: where the sleep controls live; vLLM's paths when absent."""
    api_key_secret: SecretKeyRef | None = None
    """The Secret holding the engine's own API key (vLLM's ``--api-key``), sent on ``/v1*``."""
    probe: ProbeConfig | None = None
    """How the correctness probe asks and judges; the "3 + 4 = 7" question when absent."""
    priority: int | None = Field(default=None, ge=-1000, le=1000, strict=True)
    """Switch policy: a request for a model of higher priority preempts an awake one of
    lower priority (its requests in flight finish within the drain deadline, then it
    sleeps; its later requests queue). Absent: the node's default (0)."""
    keep_alive_seconds: float | None = Field(default=None, ge=0, le=86400)
    """Switch policy: with nobody else waiting, how long the engine stays awake after its
    last request before it is put to sleep. It never keeps a waiting client out (a holder
    with nothing in flight gives way at once). Absent: the node's default."""
    max_wait_seconds: float | None = Field(default=None, gt=0, le=3600)
    """Switch policy: the bound on a request's wait for a switch while the GPU serves
    other models (anti-starvation); it is served before this bound even against a
    busy holder of higher priority. Absent: the node's default. Never shorter than the
    admin allows the claim's namespace (5 s when the admin bound nothing)."""
    share_weight: float | None = Field(default=None, gt=0, le=1000)
    """Switch policy: this model's weight in the fair share of the GPU under sustained
    contention. Absent: the node's default (1)."""
    home: bool = False
    """Switch policy: this model is its GPU's home model, woken when the GPU has been idle
    for the node's home delay (the controller's ``--home-model`` setting wins)."""
    first_token_seconds: float | None = Field(default=None, gt=0, le=3600)
    """Switch policy, service objective: a request's first token within this many seconds
    of its arrival. The policy may preempt a holder that keeps its requests to meet it.
    Absent: the node's default (``--first-token-objective-s``, 2 s). Never tighter than
    the admin allows the claim's namespace."""
    longest_freeze_seconds: float | None = Field(default=None, gt=0, le=3600)
    """Switch policy, service objective: the longest gap a started stream of this model
    may suffer while its engine sleeps with the stream kept; the policy wakes it before.
    Absent: the node's default (``--longest-freeze-s``, 3 s). Never tighter than the admin
    allows the claim's namespace."""
    keep_requests: bool | None = None
    """Whether a switch may freeze this engine's requests in flight (put it to sleep with
    them kept; they continue at its next wake) instead of waiting for them to finish.
    Absent: rota decides (:func:`keeps_requests`): true for ``adapter: vllm`` at
    ``sleepLevel: 1``, false otherwise; an ``http`` claim may set true (its engine keeps
    requests across ``/sleep?mode=keep`` as vLLM does). True is refused at ``sleepLevel:
    2`` and for ``vllm-omni``: not shown safe there. A tensor-parallel engine is drained
    whatever this says (vLLM #45520: sleeping mid-decode at TP > 1 crashes)."""

    @field_validator("model")
    @classmethod
    def _check_model(cls, value: str) -> str:
        if value != value.strip() or _CONTROL.search(value):
            raise ValueError("must not have surrounding whitespace or control characters")
        return value

    @field_validator("sleep_level", mode="before")
    @classmethod
    def _check_sleep_level(cls, value: object) -> object:
        if type(value) is not int:
            raise ValueError("must be the number 1 or 2")
        return value

    @field_validator("awake_memory", mode="before")
    @classmethod
    def _parse_awake_memory(cls, value: object) -> int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise ValueError("must be a quantity such as 60Gi or a number of bytes")
        return parse_quantity(value)

    @field_validator("omni_stage_ids")
    @classmethod
    def _check_stage_ids(cls, value: tuple[int, ...] | None) -> tuple[int, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("must list at least one stage id, or be left out for all stages")
        if len(value) > _MAX_STAGE_IDS:
            raise ValueError(f"must list at most {_MAX_STAGE_IDS} stage ids")
        if len(set(value)) != len(value):
            raise ValueError("stage ids must not repeat")
        return value

    @model_validator(mode="after")
    def _check_adapter_fields(self) -> EngineConfig:
        if self.omni_stage_ids is not None and self.adapter != "vllm-omni":
            raise ValueError(f"omniStageIds applies only to adapter vllm-omni, not {self.adapter}")
        if self.adapter == "vllm-omni":
            if self.sleep_level == 2:
                raise ValueError(
                    "sleepLevel 2 is not supported for adapter vllm-omni: vLLM-Omni (0.26, "
                    "0.30) cannot wake after a level-2 sleep (501 NotImplementedError) and "
                    "the engine stays asleep until restarted; use sleepLevel 1")
            if self.omni_stage_ids is None:
                raise ValueError(
                    "adapter vllm-omni needs omniStageIds, the pipeline's stages (vLLM-Omni "
                    "cannot list them; Qwen2.5-Omni and Qwen3-Omni have [0, 1, 2])")
        if self.keep_requests:
            self._check_keep()
        if self.http is not None and self.adapter != "http":
            raise ValueError(f"http applies only to adapter http, not {self.adapter}")
        return self

    def _check_keep(self) -> None:
        if self.adapter == "vllm-omni":
            raise ValueError(
                "keepRequests is not supported for adapter vllm-omni: its stages sleep "
                "without pausing (a request running on a stage is not kept); leave it out")
        if self.sleep_level == 2:
            raise ValueError(
                "keepRequests is not supported with sleepLevel 2: kept requests are "
                "recomputed after a wake that reloads the weights from disk, which is not "
                "shown safe; use sleepLevel 1 or leave keepRequests out")

    def to_parameters(self) -> dict[str, Any]:
        """The config as opaque parameters (camelCase JSON), fields at their defaults left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=True)


def keeps_requests(config: EngineConfig, *, gang: bool) -> bool:
    """Whether a switch may put this claim's engine to sleep with its requests kept
    (``keepRequests`` as it takes effect): never for a tensor-parallel ``gang`` (vLLM
    #45520), never at level 2 or for vLLM-Omni; the claim's word where it gave one; by
    default for vLLM at level 1, the case measured on real engines."""
    if gang or config.sleep_level != 1 or config.adapter == "vllm-omni":
        return False
    if config.keep_requests is not None:
        return config.keep_requests
    return config.adapter == "vllm"


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe(error: Mapping[str, Any]) -> str:
    where = ".".join(_cut(str(part), _MAX_SHOWN_INPUT) for part in error["loc"]) or "parameters"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unknown field"
    elif error["type"] == "missing":
        message = "required field is missing"
    return f"{where}: {_cut(message, 200)}"


def _flatten(error: ValidationError) -> str:
    parts = [_describe(item) for item in error.errors(include_url=False, include_input=False)]
    return _cut("; ".join(parts), _MAX_MESSAGE_CHARS)


def _supported_list() -> str:
    return ", ".join(
        f"{version} (kind {' or '.join(kinds)})" for version, kinds in SUPPORTED.items()
    )


def parse_engine_config(parameters: object) -> EngineConfig:
    """Validate a claim's opaque parameters for ``gpu.rota.dev``.

    Raises:
        OpaqueConfigError: the parameters are not an object, name an apiVersion or kind this
            release does not know, or break a field rule. The message names every bad field
            in one line and quotes at most a few dozen characters of user input.
    """
    prefix = f"invalid opaque config for driver {API_GROUP}"
    if not isinstance(parameters, Mapping):
        raise OpaqueConfigError(
            f"{prefix}: parameters must be a JSON object, not {type(parameters).__name__}"
        )
    api_version = parameters.get("apiVersion")
    kind = parameters.get("kind")
    if not isinstance(api_version, str) or api_version not in SUPPORTED:
        shown = _cut(repr(api_version), _MAX_SHOWN_INPUT) if api_version is not None else "none"
        raise OpaqueConfigError(
            f"{prefix}: unsupported apiVersion {shown}; supported: {_supported_list()}"
        )
    if not isinstance(kind, str) or kind not in SUPPORTED[api_version]:
        shown = _cut(repr(kind), _MAX_SHOWN_INPUT) if kind is not None else "none"
        raise OpaqueConfigError(
            f"{prefix}: unsupported kind {shown} in {api_version}; supported: "
            f"{' or '.join(SUPPORTED[api_version])}"
        )
    try:
        # Python code may build the model by field name; users must write the JSON names.
        return EngineConfig.model_validate(dict(parameters), by_alias=True, by_name=False)
    except ValidationError as exc:
        raise OpaqueConfigError(f"{prefix}: {_flatten(exc)}") from None
