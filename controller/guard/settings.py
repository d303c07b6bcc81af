"""The engine guard's settings: parsed once at start, every field also an env var.

The flag is ``--<field-with-dashes>`` and the environment variable ``ROTA_GUARD_<FIELD>``;
flags win over the environment, which wins over defaults. Secrets are never values here:
the engine's API key is read from a file (a mounted Secret), and the control token is the
claim's own, which rota's driver writes into the guard's environment
(``ROTA_CONTROL_TOKEN``, through CDI; :mod:`controller.guard.app` reads it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rota.kit.settings import parse_settings

__all__ = ["ENV_PREFIX", "GuardSettings", "load"]

ENV_PREFIX = "ROTA_GUARD_"
MIB = 2**20

_DESCRIPTION = (
    "rota's engine guard: an authenticating proxy in the engine pod. It exposes the OpenAI "
    "surface (checking the engine's API key) and rota's control calls (checking the "
    "claim's control token, ROTA_CONTROL_TOKEN, which rota's driver puts in the "
    "environment of every container that uses the claim) on the pod's port, and keeps the "
    "engine's own port on loopback. After '--', the engine's command: the guard then "
    "starts it, without ROTA_CONTROL_TOKEN, and exits with its status.")


class GuardSettings(BaseModel):
    """Everything the engine guard can be told."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field(default="::", description="Address to listen on (the pod's); '::' is "
                      "every IPv6 and IPv4 address (one dual-stack socket).")
    port: int = Field(default=8000, ge=0, le=65535,
                      description="Port to listen on: the claim's enginePort; 0 picks one.")
    upstream: str = Field(default="http://127.0.0.1:8001", description="The engine's own "
                          "address; keep it on loopback (vLLM: --host 127.0.0.1).")
    api_key_file: Path | None = Field(default=None, description="File holding the engine's "
                                      "API key; when set, /v1*, /tokenize and /detokenize "
                                      "need 'Authorization: Bearer <key>'.")
    connect_timeout_s: float = Field(default=5.0, gt=0, description="Connecting to the "
                                     "engine.")
    read_timeout_s: float = Field(default=600.0, gt=0, description="Longest silence between "
                                  "two pieces of an answer (a stream's chunks included).")
    control_timeout_s: float = Field(default=900.0, gt=0, description="Whole control call "
                                     "(a level-2 wake reloads weights from disk).")
    max_body_bytes: int = Field(default=32 * MIB, gt=0, description="Largest request body "
                                "accepted on the OpenAI surface.")
    max_control_body_bytes: int = Field(default=1 * MIB, gt=0, description="Largest "
                                        "request body accepted on a control call.")
    token_recheck_s: float = Field(default=1.0, ge=0, description="An API key that does "
                                   "not match makes the guard re-read its file, at most "
                                   "this often (a rotated Secret takes effect at once).")
    shutdown_grace_s: float = Field(default=30.0, ge=0, description="Entrypoint mode: how "
                                    "long the engine may take to exit after SIGTERM before "
                                    "it is killed.")
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Log level (JSON lines on stderr).")

    @field_validator("upstream")
    @classmethod
    def _check_upstream(cls, value: str) -> str:
        parts = urlsplit(value)
        if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError("must be http://host:port (the engine on loopback)")
        return value.rstrip("/")

    @property
    def upstream_on_loopback(self) -> bool:
        host = urlsplit(self.upstream).hostname or ""
        return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def split_command(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the guard's flags, the engine's command after ``--``)."""
    args = list(argv)
    if "--" in args:
        at = args.index("--")
        return args[:at], args[at + 1:]
    return args, []


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
         ) -> GuardSettings:
    """Settings from flags, then ``ROTA_GUARD_*`` variables, then defaults.

    Raises:
        ConfigError: a value does not validate; the message names every problem.
    """
    settings: GuardSettings = parse_settings(GuardSettings, argv, environ,
                                             prog="rota-engine-guard",
                                             description=_DESCRIPTION,
                                             env_prefix=ENV_PREFIX)
    return settings
