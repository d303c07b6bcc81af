"""What a generation's chunks carry beyond their text when the request asks, as vLLM 0.26.

A client that must tell tokens merged into one chunk from tokens lost asks for them:

- ``return_token_ids: true`` (a vLLM extension): each chunk's choice has ``token_ids``,
  its delta's ids; the first chunk also has the prompt's (``prompt_token_ids``: in the
  choice for a text completion, at the top of the role chunk for a chat);
- ``logprobs``: a text completion's ``logprobs: N`` gives ``{"tokens", "token_logprobs",
  "top_logprobs", "text_offset"}`` with one entry per token of the chunk; a chat's
  ``logprobs: true`` (with ``top_logprobs``, default 0) gives ``{"content": [{"token",
  "logprob", "bytes", "top_logprobs"}, ...]}``;
- ``stream_options.continuous_usage_stats``: every chunk has ``usage`` so far;
  ``include_usage`` alone: a last chunk with ``choices: []`` and the usage (the engine's
  count of generated tokens).

Pure: builds the extra fields from the tokens; the stream writer adds them to its chunks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from e2e.engine_simulator.generation import token_id, token_logprob

__all__ = ["ChunkExtras"]

Kind = Literal["chat", "completion"]
_ALTERNATIVES = (" the", " a", ",", ".", " and")
"""Tokens a top-logprobs list offers beside the greedy one."""


def _top(token: str, count: int) -> list[tuple[str, float]]:
    """The greedy token and ``count`` alternatives, most likely first."""
    best = token_logprob(token)
    others = [t for t in _ALTERNATIVES if t != token][:count]
    return [(token, best)] + [(t, round(best - 1.0 - i, 4)) for i, t in enumerate(others)]


@dataclass(frozen=True)
class ChunkExtras:
    """The per-chunk fields one request asked for."""

    kind: Kind
    logprobs: int | None
    """Top alternatives per token (0: the greedy token alone); None: no logprobs."""
    return_token_ids: bool
    continuous_usage: bool
    prompt_ids: tuple[int, ...]

    @classmethod
    def of(cls, kind: Kind, fields: Mapping[str, Any], *, continuous_usage: bool,
           prompt_ids: Sequence[int]) -> ChunkExtras:
        """From the request's extra fields (``logprobs``, ``top_logprobs``,
        ``return_token_ids``)."""
        raw = fields.get("logprobs")
        logprobs: int | None
        if kind == "chat":
            top = fields.get("top_logprobs")
            logprobs = int(top or 0) if raw is True else None
        else:
            logprobs = int(raw) if isinstance(raw, int) and not isinstance(raw, bool) else None
        return cls(kind, logprobs, bool(fields.get("return_token_ids")), continuous_usage,
                   tuple(prompt_ids))

    def first(self, chunk: dict[str, Any]) -> dict[str, Any]:
        """The request's first chunk: the prompt's token ids when asked."""
        if not self.return_token_ids:
            return chunk
        if self.kind == "chat":
            return chunk | {"prompt_token_ids": list(self.prompt_ids)}
        chunk["choices"][0]["prompt_token_ids"] = list(self.prompt_ids)
        return chunk

    def _logprobs(self, tokens: Sequence[str], text_offset: int) -> dict[str, Any]:
        count = self.logprobs or 0
        if self.kind == "chat":
            return {"content": [
                {"token": t, "logprob": token_logprob(t), "bytes": list(t.encode()),
                 "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(a.encode())}
                                  for a, lp in _top(t, count)[:count]]}
                for t in tokens]}
        offsets = []
        for t in tokens:
            offsets.append(text_offset)
            text_offset += len(t)
        return {"text_offset": offsets,
                "token_logprobs": [token_logprob(t) for t in tokens],
                "tokens": list(tokens),
                "top_logprobs": [dict(_top(t, count)) for t in tokens]}

    def decorate(self, chunk: dict[str, Any], tokens: Sequence[str], *, text_offset: int,
                 usage: dict[str, int]) -> dict[str, Any]:
        """Add what was asked to a content chunk carrying ``tokens``; ``text_offset``: the
        characters sent before it; ``usage``: the counts so far."""
        choice = chunk["choices"][0]
        if self.logprobs is not None:
            choice["logprobs"] = self._logprobs(tokens, text_offset)
        if self.return_token_ids:
            choice["token_ids"] = [token_id(t) for t in tokens]
        if self.continuous_usage:
            chunk["usage"] = usage
        return chunk
