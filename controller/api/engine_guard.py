"""The contract of the engine guard with the lease controller's engine adapters and with
the gateway.

The guard (:mod:`controller.guard`) sits in front of an engine and lets control calls
(sleep, wake, reset) through only with rota's control token; the adapters
(:mod:`controller.lease.engines`) send it. Client requests pass on the paths the gateway
forwards (:data:`CLIENT_PATHS`, the routed part of :mod:`controller.gateway.surface`; a test
checks that the two agree), with the engine's own API key. Standard library only: the
guard imports nothing of the lease controller or the gateway.
"""

from __future__ import annotations

__all__ = ["CLIENT_PATHS", "CONTROL_TOKEN_HEADER"]

CONTROL_TOKEN_HEADER = "X-Rota-Control-Token"
"""The header carrying rota's control token on control calls (checked by the engine
guard; vLLM ignores it). ``Authorization`` is left to the engine's own API key."""

CLIENT_PATHS: frozenset[str] = frozenset({
    "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/chat/completions/batch",
    "/v1/messages", "/v1/messages/count_tokens",
    "/v1/audio/transcriptions", "/v1/audio/translations",
    "/v1/embeddings", "/v2/embed", "/pooling", "/classify", "/score", "/v1/score", "/rerank",
    "/v1/rerank", "/v2/rerank", "/generative_scoring",
    "/tokenize", "/detokenize", "/v1/chat/completions/render", "/v1/completions/render",
    "/v1/chat/completions/derender", "/v1/completions/derender", "/inference/v1/generate",
})
"""Every path on which the gateway forwards a client's request to an engine (vLLM 0.26's
model-bearing routes): the guard lets them through, with the engine's API key."""
