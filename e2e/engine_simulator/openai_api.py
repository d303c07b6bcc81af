"""The OpenAI-compatible endpoints, shaped like vLLM 0.26's: models, chat and text
completions.

Streams are server-sent events: ``data: <json>\\n\\n`` per chunk, one token per chunk (the
first after a kept request's recompute merges several, see :mod:`.traffic`), then
``data: [DONE]\\n\\n``; ``logprobs``, ``return_token_ids`` and ``continuous_usage_stats`` add
vLLM's per-chunk fields (:mod:`.chunk_extras`). Chunks carry no ``usage`` field; with
``stream_options.include_usage`` one last chunk has ``choices: []`` and the request's
usage. An error after the 200 went out is sent as ``data: {"error": {...}}`` followed by
``[DONE]``, so a client must read the chunks, not the status. A stream gets its 200
headers at once, even while the engine sleeps: the request is then held, silent, until a
wake (a plain request is answered only after the wake). Request bodies accept fields the
simulator does not use (temperature, top_p, ...), as vLLM does, and log them at debug level.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from e2e.engine_simulator.chunk_extras import ChunkExtras
from e2e.engine_simulator.engine import Engine
from e2e.engine_simulator.errors import SimError, error_body
from e2e.engine_simulator.generation import (
    TokenPlan,
    count_prompt_tokens,
    plan_tokens,
    prompt_token_ids,
)
from e2e.engine_simulator.keys import ENGINE_KEY
from e2e.engine_simulator.traffic import Generation, GenerationFailed

__all__ = ["ChatRequest", "CompletionRequest", "openai_routes"]

log = logging.getLogger(__name__)

OWNER = "rota-engine-simulator"
MAX_MODEL_LEN = 4096

Kind = Literal["chat", "completion"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        if self.content is None:
            return ""
        return " ".join(part.text or "" for part in self.content)


class ChatRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int]


def _engine(request: web.Request) -> Engine:
    return request.app[ENGINE_KEY]


def _validation_message(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "; ".join(parts)


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SimError(f"JSON decode error: {exc}") from exc


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


class _Shape:
    """Builds the JSON objects of one response, chat or text completion."""

    def __init__(self, kind: Kind, model: str, gen: Generation, include_usage: bool) -> None:
        self.kind = kind
        self.model = model
        self.id = f"chatcmpl-{gen.id}" if kind == "chat" else f"cmpl-{gen.id}"
        self.created = int(time.time())
        self.include_usage = include_usage

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def chunk(self, text: str | None, finish: str | None, *, role: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if text is not None:
                delta["content"] = text
            choice |= {"delta": delta, "logprobs": None, "finish_reason": finish}
            obj = "chat.completion.chunk"
        else:
            choice |= {"text": text or "", "logprobs": None, "finish_reason": finish,
                       "stop_reason": None}
            obj = "text_completion"
        return self._envelope(obj, [choice])

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        return self._envelope(obj, []) | {"usage": usage}

    def full(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish,
                                  "stop_reason": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
            obj = "chat.completion"
        else:
            choice["text"] = text
            obj = "text_completion"
        return self._envelope(obj, [choice]) | {"usage": usage}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _stream_headers() -> web.StreamResponse:
    return web.StreamResponse(
        status=200, headers={"Content-Type": "text/event-stream; charset=utf-8",
                             "Cache-Control": "no-cache"},
    )


async def _stream(
    request: web.Request, response: web.StreamResponse, engine: Engine, gen: Generation,
    plan: TokenPlan, shape: _Shape, prompt_tokens: int, extras: ChunkExtras,
) -> web.StreamResponse:
    """One chunk per engine output (several tokens after a kept request's recompute);
    usage counts what the engine generated."""
    sent = chars = 0
    try:
        if shape.kind == "chat":
            await response.write(_sse(extras.first(shape.chunk("", None, role=True))))
        try:
            async for delta in engine.deltas(gen, plan, request, prompt_tokens=prompt_tokens):
                text = "".join(delta.tokens)
                chunk = shape.chunk(text, plan.finish_reason if delta.last else None)
                if sent == 0 and shape.kind == "completion":
                    chunk = extras.first(chunk)
                sent = delta.generated
                chunk = extras.decorate(chunk, delta.tokens, text_offset=chars,
                                        usage=_usage(prompt_tokens, sent))
                chars += len(text)
                await response.write(_sse(chunk))
            if gen.aborted.is_set():
                await response.write(_sse(shape.chunk("", "abort")))
            if shape.include_usage:
                await response.write(_sse(shape.usage_chunk(_usage(prompt_tokens, sent))))
        except GenerationFailed as exc:
            log.warning("generation failed mid-stream", extra={"request_id": shape.id})
            await response.write(_sse(error_body(str(exc), "InternalServerError", 500)))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
    except (ConnectionResetError, SimError):
        log.info("client left during a stream", extra={"request_id": shape.id, "tokens": sent})
    return response


async def _stream_error(response: web.StreamResponse, error: SimError) -> web.StreamResponse:
    """An error after the 200 headers went out: an error event, then ``[DONE]``."""
    try:
        await response.write(_sse(error.body()))
        await response.write(_sse("[DONE]"))
        await response.write_eof()
    except ConnectionResetError:
        pass
    return response


async def _collect(
    request: web.Request, engine: Engine, gen: Generation, plan: TokenPlan, shape: _Shape,
    prompt_tokens: int,
) -> web.Response:
    tokens = []
    try:
        async for token in engine.tokens(gen, plan, request):
            tokens.append(token)
    except GenerationFailed as exc:
        raise SimError(str(exc), status=500, err_type="InternalServerError") from exc
    finish = "abort" if gen.aborted.is_set() else plan.finish_reason
    body = shape.full("".join(tokens), finish, _usage(prompt_tokens, len(tokens)))
    return web.json_response(body)


async def _generate(request: web.Request, kind: Kind) -> web.StreamResponse:
    engine = _engine(request)
    served = engine.settings.model
    body = await _json_body(request)
    schema: type[_GenerationRequest] = ChatRequest if kind == "chat" else CompletionRequest
    try:
        parsed = schema.model_validate(body)
    except ValidationError as exc:
        raise SimError(_validation_message(exc)) from exc
    if parsed.model_extra:
        log.debug("request fields ignored by the simulator",
                  extra={"fields": sorted(parsed.model_extra)})
    if parsed.model is not None and parsed.model != served:
        raise SimError(f"The model `{parsed.model}` does not exist.", status=404,
                       err_type="NotFoundError")
    if parsed.n != 1:
        raise SimError("the engine simulator supports n=1 only")
    if parsed.stream_options is not None and not parsed.stream:
        raise SimError("Stream options can only be defined when `stream=True`.")
    max_tokens = parsed.max_tokens
    if isinstance(parsed, ChatRequest):
        prompt = "\n".join(message.text() for message in parsed.messages)
        prompt_tokens = count_prompt_tokens(prompt) + 4 * len(parsed.messages)
        max_tokens = parsed.max_completion_tokens or max_tokens
    else:
        assert isinstance(parsed, CompletionRequest)
        if isinstance(parsed.prompt, str):
            prompt, prompt_tokens = parsed.prompt, count_prompt_tokens(parsed.prompt)
        elif parsed.prompt and all(isinstance(p, int) for p in parsed.prompt):
            prompt, prompt_tokens = "", len(parsed.prompt)
        elif len(parsed.prompt) == 1:
            prompt = str(parsed.prompt[0])
            prompt_tokens = count_prompt_tokens(prompt)
        else:
            raise SimError("the engine simulator takes exactly one prompt per request")
    include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
    refused = engine.refusal()
    if refused is not None and not (parsed.stream and refused.status == 500):
        raise refused
    response: web.StreamResponse | None = None
    if parsed.stream:  # vLLM sends the 200 at once, before the scheduler runs the request
        response = _stream_headers()
        await response.prepare(request)
    try:
        gen = await engine.admit(request)
    except SimError as exc:
        if response is None:
            raise
        if exc.status == 499:
            return response
        return await _stream_error(response, exc)
    try:
        plan = plan_tokens(prompt, max_tokens=max_tokens, ignore_eos=parsed.ignore_eos,
                           quality=gen.quality, model=served)
        shape = _Shape(kind, served, gen, include_usage)
        if response is not None:
            ids = prompt_token_ids(prompt)
            if isinstance(parsed, CompletionRequest) and not prompt:  # token ids given
                ids = [p for p in parsed.prompt if isinstance(p, int)]
            extras = ChunkExtras.of(kind, parsed.model_extra or {}, prompt_ids=ids,
                                    continuous_usage=bool(
                                        parsed.stream_options
                                        and parsed.stream_options.continuous_usage_stats))
            return await _stream(request, response, engine, gen, plan, shape, prompt_tokens,
                                 extras)
        return await _collect(request, engine, gen, plan, shape, prompt_tokens)
    finally:
        await engine.finish(gen)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, "completion")


async def models(request: web.Request) -> web.Response:
    engine = _engine(request)
    name = engine.settings.model
    card = {"id": name, "object": "model", "created": engine.started_at, "owned_by": OWNER,
            "root": name, "parent": None, "max_model_len": MAX_MODEL_LEN, "permission": []}
    return web.json_response({"object": "list", "data": [card]})


def openai_routes() -> list[web.RouteDef]:
    return [
        web.get("/v1/models", models),
        web.post("/v1/chat/completions", chat_completions),
        web.post("/v1/completions", completions),
    ]
