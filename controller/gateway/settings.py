"""The gateway's settings: parsed once at start, passed explicitly, every field also an env var.

Nothing else in the gateway reads ``os.environ``. Each field's description is its
``--help`` text; the flag is ``--<field-with-dashes>`` and the environment variable
``ROTA_GATEWAY_<FIELD>``. Flags win over environment variables, which win over defaults.

Secrets are never values here: the activation token and the client API keys are read
from files (mounted Secrets), named by :attr:`GatewaySettings.activation_token_file` and
:attr:`GatewaySettings.api_keys_file`.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rota.api import naming
from rota.api.engine_config import DEFAULT_LONGEST_FREEZE_SECONDS
from rota.kit.errors import ConfigError
from rota.kit.settings import build_parser as settings_parser
from rota.kit.settings import parse_settings

__all__ = ["ENV_PREFIX", "PROG", "GatewaySettings", "SettingsError", "build_parser", "env_name",
           "load"]

ENV_PREFIX = "ROTA_GATEWAY_"
MIB = 2**20


SettingsError = ConfigError
"""The flags or environment variables do not make valid settings."""


class GatewaySettings(BaseModel):
    """Everything the gateway can be told."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="::", description="Address to listen on; '::' is every IPv6 "
                      "and IPv4 address (one dual-stack socket), '0.0.0.0' IPv4 only.")
    port: int = Field(default=8080, ge=0, le=65535,
                      description="Port to listen on; 0 picks a free one.")
    kubeconfig: str | None = Field(default=None, description="kubeconfig file; the pod's "
                                   "service account when unset.")
    controller_namespace: str = Field(default=naming.DEFAULT_NAMESPACE, min_length=1,
                                      description="Namespace of the lease controllers' "
                                                  "Leases (GPU and controller Leases).")
    activation_token_file: Path | None = Field(
        default=None, description="File holding the bearer token for the controllers' "
                                  "activation API (a mounted Secret); re-read periodically.")
    api_keys_file: Path | None = Field(
        default=None, description="File of client API keys, one per line (a mounted Secret). "
                                  "When set, /v1/* needs 'Authorization: Bearer <key>'.")
    serving_namespaces: tuple[str, ...] = Field(
        default=(), description="Comma-separated namespaces (shell patterns allowed, '*' for "
                                "all) whose claimants may serve any model name that the "
                                "model binding file does not bind. Claimants elsewhere are "
                                "never routed to.")
    claim_namespaces: tuple[str, ...] = Field(
        default=(), description="Comma-separated namespaces to watch ResourceClaims in, one "
                                "watch each (what a Role per namespace allows; the chart "
                                "sets its engineNamespaces). Empty: every namespace, one "
                                "cluster-wide watch (a ClusterRole). Claims elsewhere are "
                                "never seen, so never served.")
    model_binding_file: Path | None = Field(
        default=None, description="YAML file (a mounted ConfigMap) binding model names to "
                                  "the only namespaces that may serve them: 'models: "
                                  "{<model>: [<namespace>, ...]}' and 'namespaces: [...]' "
                                  "(as --serving-namespaces); re-read periodically.")
    secret_reload_s: float = Field(default=30.0, gt=0, description="How often the token and "
                                   "key files are re-read (Secret rotation).")
    max_body_bytes: int = Field(default=1 * MIB, ge=1024, description="Largest request body "
                                "accepted; larger ones get 413.")
    max_upload_bytes: int = Field(default=25 * MIB, ge=1024, description="Largest multipart "
                                  "upload accepted (audio transcriptions and translations); "
                                  "larger ones get 413. Each waiting upload is held in "
                                  "memory.")
    body_timeout_s: float = Field(default=10.0, gt=0, description="A request body must arrive "
                                  "within this many seconds, else 408.")
    max_concurrency_per_engine: int = Field(
        default=64, ge=1, description="Requests per model this replica serves at once, for "
                                      "each engine that serves the model (a model on four "
                                      "engines: four times as many).")
    queue_size: int = Field(default=256, ge=0, description="Requests per model that may wait "
                            "for a place beyond its concurrency limit; more get 429.")
    max_wait_s: float = Field(default=180.0, gt=0, description="Longest a request waits (queue, "
                              "a switch, a held drain) before it gets 503.")
    retry_after_s: int = Field(default=2, ge=1, description="Retry-After (seconds) on a 429 or "
                               "503 when nothing was measured: no hint from the controller "
                               "or the engine, no expected switch, no measured switch cost "
                               "of a model that sleeps.")
    activation_timeout_s: float = Field(default=180.0, gt=0, description="Timeout of one call "
                                        "to a controller's activation API (it answers when the "
                                        "switch is done).")
    activation_connect_timeout_s: float = Field(default=5.0, gt=0, description="Timeout to "
                                                "connect to a controller's activation API.")
    activation_attempts: int = Field(default=3, ge=1, le=10, description="Attempts of an "
                                     "activation call that could not reach the controller.")
    upstream_connect_timeout_s: float = Field(default=5.0, gt=0, description="Timeout to "
                                              "connect to an engine.")
    upstream_read_timeout_s: float = Field(default=300.0, gt=0, description="Longest silence "
                                           "between two chunks of an engine's answer, on top "
                                           "of the freeze its claim allows (a freeze is never "
                                           "a timeout: see --longest-freeze-s).")
    longest_freeze_s: float = Field(
        default=DEFAULT_LONGEST_FREEZE_SECONDS, gt=0, le=3600, description="The longest "
                                    "freeze of a started answer (its engine asleep with the "
                                    "request kept) for a claim whose config names none "
                                    "(longestFreezeSeconds); keep it equal to the lease "
                                    "controllers' --longest-freeze-s (the chart sets both "
                                    "from controller.policy.longestFreezeSeconds). The "
                                    "claim's bound plus "
                                    "its model's measured switch cost is added to "
                                    "--upstream-read-timeout-s.")
    upstream_attempts: int = Field(default=4, ge=1, le=10, description="Attempts of one request "
                                   "whose engine was not serving (asleep, unreachable) before "
                                   "any byte reached the client.")
    lost_gpu_grace_s: float = Field(default=2.0, ge=0, description="After an engine refused a "
                                    "request as asleep, how long to wait for the Lease to show "
                                    "the switch before passing the refusal on.")
    stream_keepalive_s: float = Field(default=10.0, ge=0, description="A streamed request "
                                      "still waiting (queue, switch) after this many seconds "
                                      "gets its 200 SSE answer started and an SSE comment "
                                      "this often until the engine answers; 0 turns it off.")
    stream_heartbeat_s: float = Field(default=5.0, ge=0, description="A started event "
                                      "stream that gets no bytes from its engine (frozen "
                                      "while another model holds the GPU, or slow) gets an "
                                      "SSE comment this often, between events, so that "
                                      "proxies with idle timeouts keep it; 0 turns it off.")
    engine_key_ttl_s: float = Field(default=60.0, gt=0, description="How long an engine API "
                                    "key read from its Secret is used before it is read "
                                    "again.")
    shutdown_delay_s: float = Field(default=5.0, ge=0, description="On SIGTERM: readiness "
                                    "fails at once, but new requests are still served this "
                                    "long, while load balancers and Service endpoints catch "
                                    "up.")
    shutdown_grace_s: float = Field(default=600.0, ge=0, description="On SIGTERM, after the "
                                    "delay: how long requests in flight (the longest stream) "
                                    "may take to finish before they are cut. Keep "
                                    "terminationGracePeriodSeconds above delay + grace.")
    api_timeout_s: float = Field(default=10.0, gt=0, description="Timeout of each Kubernetes "
                                 "API call.")
    api_qps: float = Field(default=20.0, ge=0, description="Client-side limit on Kubernetes "
                           "API requests per second (a token bucket; 0: none).")
    api_burst: int = Field(default=40, ge=1, description="Kubernetes API requests that may "
                           "go out at once, above --api-qps, after a quiet spell.")
    watch_timeout_s: int = Field(default=60, ge=1, description="Server-side timeout of one "
                                 "Kubernetes watch; the watch re-opens after it.")
    resync_s: float = Field(default=300.0, gt=0, description="Full re-list of claims, pods and "
                            "Leases at least this often.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="debug | info | warning | error")


    @field_validator("serving_namespaces", "claim_namespaces", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value


def env_name(field: str) -> str:
    """The environment variable of a settings field."""
    return ENV_PREFIX + field.upper()


PROG = "rota-controller gateway"
"""The gateway's one name in usage and errors: the installed script and its command."""
_DESCRIPTION = ("rota's OpenAI-compatible gateway: routes each request by model to the "
                "engine awake on its GPU and asks the node's lease controller to switch "
                "when the model is asleep.")


def build_parser() -> argparse.ArgumentParser:
    """One ``--flag`` per field; help = description, env var and default."""
    return settings_parser(GatewaySettings, PROG, _DESCRIPTION, env_prefix=ENV_PREFIX)


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
         ) -> GatewaySettings:
    """Settings from flags, then ``ROTA_GATEWAY_*`` variables, then defaults.

    Raises:
        SettingsError: a value does not validate; the message names every problem.
    """
    settings: GatewaySettings = parse_settings(GatewaySettings, argv, environ, prog=PROG,
                                               description=_DESCRIPTION,
                                               env_prefix=ENV_PREFIX)
    return settings
