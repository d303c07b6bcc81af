"""The rest of vLLM 0.26's model-bearing routes: Anthropic's messages, audio, pooling,
classify, Cohere's embed, batches, render and derender, token generation, generative
scoring.

Like :mod:`~e2e.engine_simulator.extra_api`, each request is admitted as a generation is
(held while the engine sleeps or is paused, counted in the drain gauges), names the served
model (404 otherwise; ``model`` may be left out, as vLLM allows) and gets a deterministic
answer in the shape vLLM gives, reduced to the fields its clients read:

- ``POST /v1/messages``: Anthropic's Messages API; the answer's text is what a chat
  completion would say (``7`` for "3 + 4"); ``stream`` gives Anthropic's typed events
  (``message_start`` ... ``message_stop``). ``/v1/messages/count_tokens``: ``input_tokens``.
- ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``: a
  ``multipart/form-data`` upload with ``file`` and ``model`` (and ``stream``) fields, as the
  OpenAI SDK sends it; the "transcript" is the file's bytes read as UTF-8 text, so a test
  knows what to expect. ``stream=true`` sends one ``transcription.chunk`` per word, then
  ``[DONE]``.
- ``POST /v2/embed`` (Cohere's shape), ``/pooling`` (raw vectors), ``/classify`` (two
  classes from the text's digest), ``/generative_scoring`` (a score per item).
- ``POST /v1/chat/completions/batch``: one chat completion per conversation.
- ``POST /v1/chat/completions/render``, ``/v1/completions/render``: the prompt's token ids
  (one per character, as ``/tokenize``); ``.../derender``: the text of token ids.
- ``POST /inference/v1/generate``: tokens in, tokens out (``stream`` as SSE).

And the model-bearing routes of later releases, each served only when the simulated
release (``--vllm-version``) serves it, else FastAPI's 404 (``{"detail": "Not Found"}``)
as that release answers:

- ``POST /cohere/v2/chat`` (0.27 on): Cohere's Chat v2 API (``model`` required); the
  answer's text is what a chat completion would say; ``stream`` gives Cohere's typed
  events as bare ``data:`` lines (``message-start`` ... ``message-end``), then
  ``data: [DONE]``; errors in Cohere's ``{"message", "id"}`` shape.
  ``/cohere/v2/chat/render`` (0.29 on): the prompt's token ids, as the other renders.
- ``POST /v1/messages/render`` (0.29 on), ``/v1/responses/render`` (0.30 on): the token ids
  of an Anthropic messages or a Responses request.
- ``POST /v1/systemone`` (0.32 on, ``model`` optional) and ``/v1/decisions`` (0.33 on,
  ``model`` required): a deterministic answer to each question; both refuse fields they do
  not know (``stream`` included), as vLLM's request models forbid them.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from aiohttp import web
from pydantic import ConfigDict, Field

from controller.lease.engines.surfaces import surface_for
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.errors import SimError
from e2e.engine_simulator.extra_api import (
    Request,
    admitted,
    parse_request,
    similarity,
    vector,
)
from e2e.engine_simulator.generation import count_prompt_tokens, plan_tokens
from e2e.engine_simulator.keys import ENGINE_KEY

__all__ = ["surface_routes"]


def _text(content: Any) -> str:
    """The text of a message's content: a string, or a list of parts with ``text``."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


class MessagesRequest(Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stream: bool = False


class CountTokensRequest(Request):
    messages: list[dict[str, Any]] = Field(min_length=1)


class InputRequest(Request):
    input: str | list[str]


class CohereEmbedRequest(Request):
    texts: list[str] = Field(min_length=1)


class BatchChatRequest(Request):
    messages: list[list[dict[str, Any]]] = Field(min_length=1)


class RenderRequest(Request):
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None


class DerenderRequest(Request):
    token_ids: list[int]


class GenerateRequest(Request):
    token_ids: list[int] = Field(min_length=1)
    stream: bool = False


class GenerativeScoringRequest(Request):
    query: str
    items: list[str] = Field(min_length=1)


class CohereChatRequest(Request):
    model: str = Field(min_length=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False


class MessagesRenderRequest(Request):
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None


class ResponsesRenderRequest(Request):
    input: str | list[dict[str, Any]]
    instructions: str | None = None


class SystemOneRequest(Request):
    model_config = ConfigDict(extra="forbid")

    state: Any
    questions: dict[str, dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None


class DecisionsRequest(Request):
    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    questions: list[dict[str, Any]] = Field(min_length=1, max_length=200)


def _prompt(messages: list[dict[str, Any]]) -> str:
    return "\n".join(_text(m.get("content")) for m in messages)


def _inputs(body: InputRequest) -> list[str]:
    return [body.input] if isinstance(body.input, str) else list(body.input)


async def _answer(request: web.Request, engine: Engine, prompt: str,
                  max_tokens: int | None) -> list[str]:
    gen = await engine.admit(request)
    try:
        plan = plan_tokens(prompt, max_tokens=max_tokens, ignore_eos=False,
                           quality=gen.quality)
        return [t async for t in engine.tokens(gen, plan, request)]
    finally:
        await engine.finish(gen)


def _anthropic_event(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps({"type": kind} | payload, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


async def messages(request: web.Request) -> web.StreamResponse:
    engine, body = await parse_request(request, MessagesRequest)
    prompt = _prompt(body.messages)
    model, mid = engine.settings.model, f"msg_{uuid.uuid4().hex}"
    usage = {"input_tokens": count_prompt_tokens(prompt), "output_tokens": 0}
    message: dict[str, Any] = {"id": mid, "type": "message", "role": "assistant",
                               "model": model, "content": [], "stop_reason": None,
                               "stop_sequence": None, "usage": usage}
    if not body.stream:
        tokens = await _answer(request, engine, prompt, body.max_tokens)
        return web.json_response(message | {
            "content": [{"type": "text", "text": "".join(tokens)}], "stop_reason": "end_turn",
            "usage": usage | {"output_tokens": len(tokens)}})
    gen = await engine.admit(request)
    try:
        plan = plan_tokens(prompt, max_tokens=body.max_tokens, ignore_eos=False,
                           quality=gen.quality)
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(_anthropic_event("message_start", {"message": message}))
        await response.write(_anthropic_event("content_block_start", {
            "index": 0, "content_block": {"type": "text", "text": ""}}))
        count = 0
        async for token in engine.tokens(gen, plan, request):
            count += 1
            await response.write(_anthropic_event("content_block_delta", {
                "index": 0, "delta": {"type": "text_delta", "text": token}}))
        await response.write(_anthropic_event("content_block_stop", {"index": 0}))
        await response.write(_anthropic_event("message_delta", {
            "delta": {"stop_reason": "end_turn", "stop_sequence": None},
            "usage": {"output_tokens": count}}))
        await response.write(_anthropic_event("message_stop", {}))
        await response.write_eof()
        return response
    finally:
        await engine.finish(gen)


async def count_tokens(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, CountTokensRequest)
    await admitted(request, engine)
    return web.json_response({"input_tokens": count_prompt_tokens(_prompt(body.messages))})


async def audio(request: web.Request) -> web.StreamResponse:
    """A transcription or translation: the upload's bytes, read as text, are the words."""
    engine = request.app[ENGINE_KEY]
    if request.content_type != "multipart/form-data":
        raise SimError("Expected a multipart/form-data body")
    form = await request.post()
    upload = form.get("file")
    if not isinstance(upload, web.FileField):
        raise SimError("file: Field required")
    model = form.get("model")
    if isinstance(model, str) and model and model != engine.settings.model:
        raise SimError(f"The model `{model}` does not exist.", status=404,
                       err_type="NotFoundError")
    text = upload.file.read().decode("utf-8", errors="replace").strip()
    await admitted(request, engine)
    stream = form.get("stream")
    if not (isinstance(stream, str) and stream.lower() in ("true", "1")):
        return web.json_response({"text": text, "usage": {
            "type": "duration", "seconds": max(1, len(text.split()))}})
    response = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
    await response.prepare(request)
    rid = f"trsc-{uuid.uuid4().hex}"
    for index, word in enumerate(text.split()):
        chunk = {"id": rid, "object": "transcription.chunk", "created": int(time.time()),
                 "model": engine.settings.model,
                 "choices": [{"delta": {"content": (" " if index else "") + word}}]}
        await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def cohere_embed(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, CohereEmbedRequest)
    await admitted(request, engine)
    return web.json_response({"id": f"embd-{uuid.uuid4().hex}", "texts": body.texts,
                              "embeddings": {"float": [vector(t) for t in body.texts]},
                              "meta": {"billed_units": {"input_tokens": sum(
                                  count_prompt_tokens(t) for t in body.texts)}}})


async def pooling(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, InputRequest)
    await admitted(request, engine)
    data = [{"index": i, "object": "pooling", "data": vector(t)}
            for i, t in enumerate(_inputs(body))]
    return web.json_response({"id": f"pool-{uuid.uuid4().hex}", "object": "list",
                              "created": int(time.time()), "model": engine.settings.model,
                              "data": data})


async def classify(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, InputRequest)
    await admitted(request, engine)
    data = []
    for i, text in enumerate(_inputs(body)):
        first = (vector(text)[0] + 1) / 2
        probs = [round(first, 6), round(1 - first, 6)]
        data.append({"index": i, "label": "LABEL_0" if probs[0] >= probs[1] else "LABEL_1",
                     "probs": probs, "num_classes": 2})
    return web.json_response({"id": f"classify-{uuid.uuid4().hex}", "object": "list",
                              "created": int(time.time()), "model": engine.settings.model,
                              "data": data})


async def generative_scoring(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, GenerativeScoringRequest)
    await admitted(request, engine)
    return web.json_response({"id": f"genscore-{uuid.uuid4().hex}", "object": "list",
                              "model": engine.settings.model,
                              "data": [{"index": i, "score": similarity(body.query, item)}
                                       for i, item in enumerate(body.items)]})


async def chat_batch(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, BatchChatRequest)
    model = engine.settings.model
    answers = []
    for conversation in body.messages:
        tokens = await _answer(request, engine, _prompt(conversation), None)
        answers.append({"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                        "created": int(time.time()), "model": model, "choices": [{
                            "index": 0, "finish_reason": "stop", "message": {
                                "role": "assistant", "content": "".join(tokens)}}]})
    return web.json_response({"object": "list", "model": model, "data": answers})


async def render(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, RenderRequest)
    if body.prompt is None and body.messages is None:
        raise SimError("either prompt or messages is required")
    text = body.prompt if body.prompt is not None else _prompt(body.messages or [])
    await admitted(request, engine)
    return web.json_response({"model": engine.settings.model,
                              "token_ids": [ord(c) for c in text]})


async def derender(request: web.Request) -> web.Response:
    engine, body = await parse_request(request, DerenderRequest)
    if any(not 0 <= t <= 0x10FFFF for t in body.token_ids):
        raise SimError("token id out of range")
    await admitted(request, engine)
    return web.json_response({"model": engine.settings.model,
                              "text": "".join(chr(t) for t in body.token_ids)})


async def generate(request: web.Request) -> web.StreamResponse:
    engine, body = await parse_request(request, GenerateRequest)
    prompt = "".join(chr(t) for t in body.token_ids if 0 <= t <= 0x10FFFF)
    tokens = await _answer(request, engine, prompt, None)
    ids = [ord(c) for c in "".join(tokens)]
    if not body.stream:
        return web.json_response({"request_id": uuid.uuid4().hex,
                                  "choices": [{"index": 0, "token_ids": ids,
                                               "finish_reason": "stop"}]})
    response = web.StreamResponse(status=200, headers={
        "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
    await response.prepare(request)
    for token in ids:
        await response.write(f"data: {json.dumps({'token_ids': [token]})}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _served(request: web.Request) -> None:
    """FastAPI's 404 unless the simulated release serves this route."""
    surface = surface_for(request.app[ENGINE_KEY].settings.vllm_version)
    if surface is None or not surface.serves(request.method, request.path):
        raise web.HTTPNotFound()


def _cohere_error(request: web.Request, exc: SimError) -> web.Response:
    """vLLM's Cohere routes answer errors as ``{"message", "id"}``."""
    body: dict[str, Any] = {"message": exc.message}
    if request.headers.get("X-Request-Id"):
        body["id"] = request.headers["X-Request-Id"]
    return web.json_response(body, status=exc.status)


def _cohere_event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


async def cohere_chat(request: web.Request) -> web.StreamResponse:
    _served(request)
    try:
        engine, body = await parse_request(request, CohereChatRequest)
    except SimError as exc:
        return _cohere_error(request, exc)
    prompt = _prompt(body.messages)
    cid = uuid.uuid4().hex
    prompt_tokens = count_prompt_tokens(prompt)
    if not body.stream:
        tokens = await _answer(request, engine, prompt, body.max_tokens)
        return web.json_response({
            "id": cid, "finish_reason": "COMPLETE",
            "message": {"role": "assistant",
                        "content": [{"type": "text", "text": "".join(tokens)}]},
            "usage": {"billed_units": {"input_tokens": prompt_tokens,
                                       "output_tokens": len(tokens)}}})
    gen = await engine.admit(request)
    try:
        plan = plan_tokens(prompt, max_tokens=body.max_tokens, ignore_eos=False,
                           quality=gen.quality)
        response = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(_cohere_event({"type": "message-start", "id": cid, "delta": {
            "message": {"role": "assistant"}}}))
        await response.write(_cohere_event({"type": "content-start", "index": 0, "delta": {
            "message": {"content": {"type": "text", "text": ""}}}}))
        count = 0
        async for token in engine.tokens(gen, plan, request):
            count += 1
            await response.write(_cohere_event({"type": "content-delta", "index": 0, "delta": {
                "message": {"content": {"text": token}}}}))
        await response.write(_cohere_event({"type": "content-end", "index": 0}))
        await response.write(_cohere_event({"type": "message-end", "delta": {
            "finish_reason": "COMPLETE", "usage": {"billed_units": {
                "input_tokens": prompt_tokens, "output_tokens": count}}}}))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    finally:
        await engine.finish(gen)


async def _render_text(request: web.Request, engine: Engine, text: str) -> web.Response:
    await admitted(request, engine)
    return web.json_response({"model": engine.settings.model,
                              "token_ids": [ord(c) for c in text]})


async def cohere_chat_render(request: web.Request) -> web.Response:
    _served(request)
    try:
        engine, body = await parse_request(request, CohereChatRequest)
    except SimError as exc:
        return _cohere_error(request, exc)
    return await _render_text(request, engine, _prompt(body.messages))


async def messages_render(request: web.Request) -> web.Response:
    _served(request)
    engine, body = await parse_request(request, MessagesRenderRequest)
    system = _text(body.system) if body.system is not None else ""
    return await _render_text(request, engine,
                              "\n".join(filter(None, [system, _prompt(body.messages)])))


async def responses_render(request: web.Request) -> web.Response:
    _served(request)
    engine, body = await parse_request(request, ResponsesRenderRequest)
    text = body.input if isinstance(body.input, str) else _prompt(body.input)
    return await _render_text(request, engine,
                              "\n".join(filter(None, [body.instructions or "", text])))


def _probability(state: str, question: str) -> float:
    """A deterministic probability for a question about ``state`` (from their digest)."""
    return round((vector(f"{state}\n{question}")[0] + 1) / 2, 6)


async def systemone(request: web.Request) -> web.Response:
    _served(request)
    engine, body = await parse_request(request, SystemOneRequest)
    state = body.state if isinstance(body.state, str) else json.dumps(body.state)
    await admitted(request, engine)
    answers = {qid: {"type": str(q.get("type", "")),
                     "probability": _probability(state, json.dumps(q, sort_keys=True))}
               for qid, q in body.questions.items()}
    tokens = count_prompt_tokens(state)
    return web.json_response({
        "id": f"sd-{uuid.uuid4().hex}", "object": "structured_decision",
        "created": int(time.time()), "model": engine.settings.model, "answers": answers,
        "usage": {"input_tokens": tokens, "output_tokens": len(answers)},
        "diagnostics": {qid: {"label_mass": 1.0, "argmax_is_label": True}
                        for qid in answers}})


def _decision(text: str, question: dict[str, Any]) -> dict[str, Any]:
    """vLLM's answer to one question: a predicate's probability, a choice among its
    ``choices`` or a score among its ``levels``."""
    kind, name = question.get("type"), question.get("name")
    p = _probability(text, json.dumps(question, sort_keys=True))
    if kind == "predicate":
        return {"type": kind, "name": name, "probability": p}
    options = question.get("choices" if kind == "choice" else "levels")
    if kind not in ("choice", "score") or not isinstance(options, list) or len(options) < 2:
        raise SimError(f"questions: unknown or malformed question {kind!r}")
    picked = int(p * len(options)) % len(options)
    if kind == "choice":
        values = [o.get("value") for o in options]
        return {"type": kind, "name": name, "choice": values[picked], "confidence": p,
                "probabilities": [{"value": v, "probability": p if i == picked else
                                   round((1 - p) / (len(values) - 1), 6)}
                                  for i, v in enumerate(values)]}
    return {"type": kind, "name": name, "score": float(picked), "confidence": p,
            "probabilities": [{"value": i, "label": str(o.get("label", i)),
                               "probability": p if i == picked else
                               round((1 - p) / (len(options) - 1), 6)}
                              for i, o in enumerate(options)]}


async def decisions(request: web.Request) -> web.Response:
    _served(request)
    engine, body = await parse_request(request, DecisionsRequest)
    text = body.input if isinstance(body.input, str) else _prompt(body.input)
    answers = [_decision(text, q) for q in body.questions]
    await admitted(request, engine)
    return web.json_response({
        "model": engine.settings.model, "answers": answers,
        "usage": {"input_tokens": count_prompt_tokens(text),
                  "input_tokens_details": {"cached_tokens": 0},
                  "output_tokens": len(answers),
                  "output_tokens_details": {"reasoning_tokens": 0}}})


def surface_routes() -> list[web.RouteDef]:
    return [
        web.post("/v1/messages", messages),
        web.post("/v1/messages/count_tokens", count_tokens),
        web.post("/v1/audio/transcriptions", audio),
        web.post("/v1/audio/translations", audio),
        web.post("/v2/embed", cohere_embed),
        web.post("/pooling", pooling),
        web.post("/classify", classify),
        web.post("/generative_scoring", generative_scoring),
        web.post("/v1/chat/completions/batch", chat_batch),
        web.post("/v1/chat/completions/render", render),
        web.post("/v1/completions/render", render),
        web.post("/v1/chat/completions/derender", derender),
        web.post("/v1/completions/derender", derender),
        web.post("/inference/v1/generate", generate),
        web.post("/cohere/v2/chat", cohere_chat),
        web.post("/cohere/v2/chat/render", cohere_chat_render),
        web.post("/v1/messages/render", messages_render),
        web.post("/v1/responses/render", responses_render),
        web.post("/v1/systemone", systemone),
        web.post("/v1/decisions", decisions),
    ]
