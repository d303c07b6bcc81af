"""A request body for every JSON route the gateway routes by model, and a field its answer
must have: shared by the tests that send each route through the gateway to the engine
simulator. ``test_vllm_routes.py`` checks that every routed JSON route has one."""

from __future__ import annotations

from typing import Any

from controller.lease.engines.surfaces import supported, surface_for

__all__ = ["JSON_CASES", "REFUSES_UNKNOWN_FIELDS", "STREAMED_BODIES", "first_release",
           "rig_for"]

JSON_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 3 + 4?"}]},
     "choices"),
    ("/v1/completions", {"prompt": "3 + 4 ="}, "choices"),
    ("/v1/responses", {"input": "What is 3 + 4?"}, "output"),
    ("/v1/chat/completions/batch",
     {"messages": [[{"role": "user", "content": "What is 3 + 4?"}]]}, "data"),
    ("/v1/messages", {"max_tokens": 16,
                      "messages": [{"role": "user", "content": "What is 3 + 4?"}]}, "content"),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "3 + 4"}]},
     "input_tokens"),
    ("/v1/embeddings", {"input": ["hello world", "3 + 4"]}, "data"),
    ("/v2/embed", {"texts": ["hello world"]}, "embeddings"),
    ("/pooling", {"input": "hello world"}, "data"),
    ("/classify", {"input": ["hello world"]}, "data"),
    ("/score", {"text_1": "three plus four", "text_2": ["seven", "four"]}, "data"),
    ("/v1/score", {"text_1": "three plus four", "text_2": ["seven", "four"]}, "data"),
    ("/rerank", {"query": "three plus four", "documents": ["four", "seven"]}, "results"),
    ("/v1/rerank", {"query": "three plus four", "documents": ["four", "seven"]}, "results"),
    ("/v2/rerank", {"query": "three plus four", "documents": ["four", "seven"]}, "results"),
    ("/generative_scoring", {"query": "three plus four", "items": ["seven"]}, "data"),
    ("/tokenize", {"prompt": "3 + 4"}, "tokens"),
    ("/detokenize", {"tokens": [55]}, "prompt"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "3 + 4"}]},
     "token_ids"),
    ("/v1/completions/render", {"prompt": "3 + 4"}, "token_ids"),
    ("/v1/chat/completions/derender", {"token_ids": [55]}, "text"),
    ("/v1/completions/derender", {"token_ids": [55]}, "text"),
    ("/inference/v1/generate", {"token_ids": [51, 32, 43, 32, 52]}, "choices"),
    # Routes of later releases (each sent to simulators of its first release: rig_for).
    ("/cohere/v2/chat", {"messages": [{"role": "user", "content": "What is 3 + 4?"}]},
     "message"),
    ("/cohere/v2/chat/render", {"messages": [{"role": "user", "content": "3 + 4"}]},
     "token_ids"),
    ("/v1/messages/render", {"max_tokens": 16,
                             "messages": [{"role": "user", "content": "3 + 4"}]}, "token_ids"),
    ("/v1/responses/render", {"input": "3 + 4"}, "token_ids"),
    ("/v1/systemone", {"state": "three plus four is seven",
                       "questions": {"right": {"type": "predicate",
                                               "instructions": "Is it right?"}}}, "answers"),
    ("/v1/decisions", {"input": "three plus four is seven",
                       "questions": [{"type": "predicate", "instructions": "Is it right?"}]},
     "answers"),
]
"""(path, body without ``model``, a field of the answer)."""

REFUSES_UNKNOWN_FIELDS = frozenset({"/v1/systemone", "/v1/decisions"})
"""Routes whose vLLM request model forbids fields it does not know (``stream`` too)."""


def first_release(path: str) -> str:
    """The oldest supported vLLM release that serves ``POST path``, as its wheel says."""
    for version in supported("vllm"):
        surface = surface_for(version)
        if surface is not None and surface.serves("POST", path):
            return version
    raise AssertionError(f"no supported vLLM release serves POST {path}")


def rig_for(path: str) -> dict[str, Any]:
    """``make_rig`` arguments whose simulators speak the first vLLM release serving
    ``path`` (none for vLLM 0.26's routes: the simulator's default release)."""
    since = first_release(path)
    if since == "0.26.0":
        return {}
    release = {"vllm_version": since}
    return {"sim_a": release, "sim_b": release}

STREAMED_BODIES: dict[str, dict[str, Any]] = {
    path: body for path, body, _ in JSON_CASES
    if path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                "/inference/v1/generate", "/cohere/v2/chat")}
"""Bodies of the JSON routes that stream (``stream: true`` added by the test)."""
