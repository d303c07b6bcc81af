"""The client routes the gateway forwards to engines, by model: the contract between the
gateway (:mod:`controller.gateway.surface`, which routes them) and the engine guard
(:mod:`controller.guard.paths`, which lets them through with the engine's API key).
Standard library only: the guard imports nothing of the gateway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["CLIENT_PATHS", "ROUTED", "Dialect", "Routed"]

Dialect = Literal["openai", "anthropic"]


@dataclass(frozen=True)
class Routed:
    """A route the gateway forwards by model."""

    path: str
    body: Literal["json", "form"] = "json"
    """Where ``model`` (and ``stream``) are read: the JSON body, or the multipart form."""
    streams: bool = False
    """``stream: true`` makes the answer an event stream."""
    dialect: Dialect = "openai"
    """How an error is written inside a started stream."""
    since: str = "0.26.0"
    """The first vLLM release that serves it (each later supported release does too;
    ``tests/controller/test_engine_surfaces.py`` checks this against every release's
    route table)."""


ROUTED: tuple[Routed, ...] = (
    # OpenAI-compatible generation.
    Routed("/v1/chat/completions", streams=True),
    Routed("/v1/completions", streams=True),
    Routed("/v1/responses", streams=True),
    Routed("/v1/chat/completions/batch"),
    # Anthropic's Messages API.
    Routed("/v1/messages", streams=True, dialect="anthropic"),
    Routed("/v1/messages/count_tokens", dialect="anthropic"),
    # Audio: multipart uploads with a 'model' form field.
    Routed("/v1/audio/transcriptions", body="form", streams=True),
    Routed("/v1/audio/translations", body="form", streams=True),
    # Pooling models: embedders, classifiers, scorers and rerankers.
    Routed("/v1/embeddings"),
    Routed("/v2/embed"),
    Routed("/pooling"),
    Routed("/classify"),
    Routed("/score"),
    Routed("/v1/score"),
    Routed("/rerank"),
    Routed("/v1/rerank"),
    Routed("/v2/rerank"),
    Routed("/generative_scoring"),
    # Tokens in and out.
    Routed("/tokenize"),
    Routed("/detokenize"),
    Routed("/v1/chat/completions/render"),
    Routed("/v1/completions/render"),
    Routed("/v1/chat/completions/derender"),
    Routed("/v1/completions/derender"),
    Routed("/inference/v1/generate", streams=True),
    # Later releases.
    Routed("/cohere/v2/chat", streams=True, since="0.27.1"),
    Routed("/cohere/v2/chat/render", since="0.29.0"),
    Routed("/v1/messages/render", dialect="anthropic", since="0.29.0"),
    Routed("/v1/responses/render", since="0.30.0"),
    Routed("/v1/systemone", since="0.32.0"),
    Routed("/v1/decisions", since="0.33.0"),
)
"""Every model-bearing route of the supported vLLM releases (0.26 on), each forwarded to
the same path. A route newer than an engine's release reaches that engine all the same
(the gateway does not know which release each engine runs) and is answered by the
engine's own 404."""

CLIENT_PATHS: frozenset[str] = frozenset(route.path for route in ROUTED)
"""Every path on which a client's request reaches an engine."""
