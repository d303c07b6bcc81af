"""The rest of vLLM's OpenAI-compatible surface: embeddings, responses, rerank, score,
tokenize and detokenize, shaped like vLLM's answers.

Each request goes through the same admission as a chat completion (held while the engine
is asleep or paused, counted in the drain gauges, aborted by ``/sleep?mode=abort``), names
the served model (404 otherwise; ``model`` may be left out, as vLLM allows) and gets a
deterministic answer:

- ``POST /v1/embeddings``: one unit vector of :data:`EMBEDDING_DIM` floats per input,
  derived from the input's text; ``encoding_format`` ``float`` or ``base64`` (little-endian
  float32, what the OpenAI SDKs ask for by default).
- ``POST /v1/responses``: the Responses API; the answer's text is what a chat completion
  of the same input would say (``7`` for "3 + 4"); ``stream`` gives its typed events
  (``event: response.output_text.delta`` ...).
- ``POST /v1/rerank`` (also ``/rerank`` and ``/v2/rerank``) and ``POST /v1/score`` (also
  ``/score``): scores in [0, 1] from the words two texts
  share.
- ``POST /tokenize`` and ``POST /detokenize``: one token per character (its code point),
  so that detokenize inverts tokenize.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import time
import uuid
from typing import Any, TypeVar

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.errors import SimError
from e2e.engine_simulator.generation import count_prompt_tokens, plan_tokens
from e2e.engine_simulator.keys import ENGINE_KEY

__all__ = ["EMBEDDING_DIM", "Request", "admitted", "extra_routes", "parse_request", "similarity",
           "vector"]

EMBEDDING_DIM = 16
MAX_MODEL_LEN = 4096


class Request(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None


T = TypeVar("T", bound=Request)


class EmbeddingRequest(Request):
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: str = "float"


class ResponsesRequest(Request):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    stream: bool = False
    max_output_tokens: int | None = Field(default=None, ge=1)


class RerankRequest(Request):
    query: str
    documents: list[str]
    top_n: int | None = Field(default=None, ge=1)


class ScoreRequest(Request):
    text_1: str | list[str]
    text_2: str | list[str]


class TokenizeRequest(Request):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None


class DetokenizeRequest(Request):
    tokens: list[int]


async def parse_request(request: web.Request, schema: type[T]) -> tuple[Engine, T]:
    engine = request.app[ENGINE_KEY]
    raw = await request.read()
    try:
        parsed = schema.model_validate(json.loads(raw))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SimError(f"JSON decode error: {exc}") from exc
    except ValidationError as exc:
        raise SimError("; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                                 for e in exc.errors(include_url=False))) from exc
    if parsed.model is not None and parsed.model != engine.settings.model:
        raise SimError(f"The model `{parsed.model}` does not exist.", status=404,
                       err_type="NotFoundError")
    return engine, parsed


def _text_of(item: str | list[int]) -> str:
    return item if isinstance(item, str) else " ".join(str(t) for t in item)


def vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    raw = [b / 255.0 - 0.5 for b in digest[:EMBEDDING_DIM]]
    norm = math.sqrt(sum(v * v for v in raw)) or 1.0
    return [round(v / norm, 6) for v in raw]


def similarity(a: str, b: str) -> float:
    left, right = set(a.lower().split()), set(b.lower().split())
    return round(len(left & right) / len(left | right), 6) if left | right else 0.0


async def admitted(request: web.Request, engine: Engine) -> None:
    """Hold the request as a generation would be held, then let it go at once."""
    gen = await engine.admit(request)
    await engine.finish(gen)


async def embeddings(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, EmbeddingRequest)
    if body.encoding_format not in ("float", "base64"):
        raise SimError("encoding_format must be 'float' or 'base64'")
    raw = body.input
    items: list[str | list[int]]
    if isinstance(raw, str) or (raw and all(isinstance(t, int) for t in raw)):
        items = [raw]  # type: ignore[list-item]
    else:
        items = list(raw)  # type: ignore[arg-type]
    await admitted(request, engine)
    data, tokens = [], 0
    for index, item in enumerate(items):
        text = _text_of(item)
        tokens += count_prompt_tokens(text) if isinstance(item, str) else len(item)
        floats = vector(text)
        value: list[float] | str = floats
        if body.encoding_format == "base64":
            value = base64.b64encode(struct.pack(f"<{len(floats)}f", *floats)).decode()
        data.append({"index": index, "object": "embedding", "embedding": value})
    return web.json_response({
        "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
        "model": engine.settings.model, "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0}})


def _responses_prompt(body: ResponsesRequest) -> str:
    if isinstance(body.input, str):
        return body.input
    parts = []
    for item in body.input:
        content = item.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            parts.extend(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return "\n".join(parts)


def _response_object(model: str, rid: str, mid: str, text: str, status: str,
                     prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    output = [] if status == "in_progress" else [{
        "type": "message", "id": mid, "status": "completed", "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}]}]
    return {
        "id": rid, "object": "response", "created_at": int(time.time()), "model": model,
        "status": status, "output": output, "error": None, "incomplete_details": None,
        "instructions": None, "metadata": None, "parallel_tool_calls": True,
        "temperature": 1.0, "tool_choice": "auto", "tools": [], "top_p": 1.0,
        "usage": None if status == "in_progress" else {
            "input_tokens": prompt_tokens, "output_tokens": output_tokens,
            "total_tokens": prompt_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": 0}}}


def _event(kind: str, payload: dict[str, Any], sequence: int) -> bytes:
    data = json.dumps({"type": kind, "sequence_number": sequence} | payload,
                      separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def responses(request: web.Request) -> web.StreamResponse:
    engine, body = await parse_request(request, ResponsesRequest)
    prompt = _responses_prompt(body)
    prompt_tokens = count_prompt_tokens(prompt)
    model = engine.settings.model
    rid, mid = f"resp_{uuid.uuid4().hex}", f"msg_{uuid.uuid4().hex}"
    gen = await engine.admit(request)
    try:
        plan = plan_tokens(prompt, max_tokens=body.max_output_tokens, ignore_eos=False,
                           quality=gen.quality)
        if not body.stream:
            tokens = [t async for t in engine.tokens(gen, plan, request)]
            return web.json_response(_response_object(
                model, rid, mid, "".join(tokens), "completed", prompt_tokens, len(tokens)))
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await response.prepare(request)
        seq = 0

        async def send(kind: str, payload: dict[str, Any]) -> None:
            nonlocal seq
            await response.write(_event(kind, payload, seq))
            seq += 1

        start = _response_object(model, rid, mid, "", "in_progress", prompt_tokens, 0)
        await send("response.created", {"response": start})
        await send("response.in_progress", {"response": start})
        item = {"type": "message", "id": mid, "status": "in_progress", "role": "assistant",
                "content": []}
        await send("response.output_item.added", {"output_index": 0, "item": item})
        part = {"type": "output_text", "text": "", "annotations": []}
        where = {"item_id": mid, "output_index": 0, "content_index": 0}
        await send("response.content_part.added", where | {"part": part})
        text = []
        async for token in engine.tokens(gen, plan, request):
            text.append(token)
            await send("response.output_text.delta", where | {"delta": token, "logprobs": []})
        full = "".join(text)
        await send("response.output_text.done", where | {"text": full, "logprobs": []})
        await send("response.content_part.done", where | {"part": part | {"text": full}})
        done = _response_object(model, rid, mid, full, "completed", prompt_tokens, len(text))
        await send("response.output_item.done", {"output_index": 0,
                                                 "item": done["output"][0]})
        await send("response.completed", {"response": done})
        await response.write_eof()
        return response
    finally:
        await engine.finish(gen)


async def rerank(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, RerankRequest)
    await admitted(request, engine)
    results = sorted(({"index": i, "document": {"text": doc},
                       "relevance_score": similarity(body.query, doc)}
                      for i, doc in enumerate(body.documents)),
                     key=lambda r: -float(r["relevance_score"]))  # type: ignore[arg-type]
    tokens = sum(count_prompt_tokens(body.query + " " + d) for d in body.documents)
    return web.json_response({"id": f"rerank-{uuid.uuid4().hex}",
                              "model": engine.settings.model, "usage": {"total_tokens": tokens},
                              "results": results[:body.top_n] if body.top_n else results})


async def score(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, ScoreRequest)
    lefts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    rights = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if len(lefts) == 1:
        lefts = lefts * len(rights)
    if len(lefts) != len(rights):
        raise SimError("text_1 and text_2 must have the same length (or text_1 one item)")
    await admitted(request, engine)
    data = [{"index": i, "object": "score", "score": similarity(a, b)}
            for i, (a, b) in enumerate(zip(lefts, rights, strict=True))]
    tokens = sum(count_prompt_tokens(a + " " + b) for a, b in zip(lefts, rights, strict=True))
    return web.json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list",
                              "created": int(time.time()), "model": engine.settings.model,
                              "data": data, "usage": {"prompt_tokens": tokens,
                                                      "total_tokens": tokens}})


async def tokenize(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, TokenizeRequest)
    if body.prompt is None and body.messages is None:
        raise SimError("either prompt or messages is required")
    text = body.prompt if body.prompt is not None else "\n".join(
        str(m.get("content", "")) for m in body.messages or [])
    await admitted(request, engine)
    tokens = [ord(c) for c in text]
    return web.json_response({"count": len(tokens), "max_model_len": MAX_MODEL_LEN,
                              "tokens": tokens, "token_strs": None})


async def detokenize(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, DetokenizeRequest)
    if any(not 0 <= t <= 0x10FFFF for t in body.tokens):
        raise SimError("token id out of range")
    await admitted(request, engine)
    return web.json_response({"prompt": "".join(chr(t) for t in body.tokens)})


def extra_routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/embeddings", embeddings),
        web.post("/v1/responses", responses),
        *(web.post(path, rerank) for path in ("/v1/rerank", "/rerank", "/v2/rerank")),
        *(web.post(path, score) for path in ("/v1/score", "/score")),
        web.post("/tokenize", tokenize),
        web.post("/detokenize", detokenize),
    ]
