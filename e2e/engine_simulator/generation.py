"""Canned generations: which tokens a prompt gets, given the engine's state. Pure.

The one question with a right answer is rota's correctness probe, "3 + 4" (also "3 plus
4", any case): a healthy engine answers ``7``. Every other prompt gets filler text that is
deterministic per (model, prompt) and differs between prompts, as a greedy model's output
does: a stream handed another request's tokens, or one that lost or repeated a token, does
not match its never-slept reference. A broken engine gets it wrong the way real ones do:

- weights not reloaded after a level-2 wake: ``!!!!...`` (garbage weights);
- prefix cache not reset after a level-2 wake: ``42`` (a stale cached answer).

Without ``ignore_eos`` the natural answer ends with a stop (``finish_reason: stop``),
cut short by ``max_tokens`` (``length``). With ``ignore_eos`` the output is exactly
``max_tokens`` tokens, padded with filler, and ends with ``length``.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import re
from dataclasses import dataclass
from typing import Literal

from e2e.engine_simulator.state import Quality

__all__ = [
    "DEFAULT_IGNORE_EOS_TOKENS",
    "TokenPlan",
    "count_prompt_tokens",
    "plan_tokens",
    "prompt_token_ids",
    "token_id",
    "token_logprob",
]

DEFAULT_IGNORE_EOS_TOKENS = 256
"""Output length with ``ignore_eos`` and no ``max_tokens`` (a real engine runs to its context)."""

_QUESTION = re.compile(r"(?<!\d)3\s*(?:\+|plus)\s*4(?!\d)", re.IGNORECASE)
_FILLER = (" The", " simulated", " engine", " has", " nothing", " real", " to", " say",
           ",", " so", " it", " says", " this", " again", " and", " again", ".")
_NATURAL_FILLER_TOKENS = len(_FILLER)
_WORDS = (" a", " simulated", " engine", " says", " nothing", " real", " again", " and",
          " so", " it", " goes", " on", " with", " words", " from", " nowhere", " here",
          " there", " now", " then", ",")
_VOCABULARY = 50_000

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenPlan:
    tokens: tuple[str, ...]
    finish_reason: FinishReason


def count_prompt_tokens(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word, at least one."""
    return max(1, len(text.split()))


def token_id(token: str) -> int:
    """The stand-in tokenizer's id of ``token``: the same text, the same id."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:4], "big") % _VOCABULARY


def prompt_token_ids(prompt: str) -> list[int]:
    """Ids of the prompt's tokens (one per word, at least one, as :func:`count_prompt_tokens`)."""
    return [token_id(word) for word in prompt.split()] or [token_id(prompt)]


def token_logprob(token: str) -> float:
    """The greedy token's log-probability: deterministic, like everything here."""
    return -round((token_id(token) % 97) / 1000, 4)


def _filler(model: str, prompt: str) -> tuple[str, ...]:
    """This prompt's natural answer: 16 words drawn from a seed of (model, prompt), then a
    full stop. Without a prompt (token ids given), the fixed filler."""
    if not prompt and not model:
        return _FILLER
    seed = hashlib.sha256(f"{model}\0{prompt}".encode()).digest()
    rng = random.Random(seed)
    words = [rng.choice(_WORDS) for _ in range(_NATURAL_FILLER_TOKENS - 1)]
    return (" The", *words[1:], ".")


def _natural(prompt: str, quality: Quality, model: str) -> tuple[list[str], str]:
    """The answer the model wants to give, and the token it pads with."""
    if quality is Quality.GARBAGE_WEIGHTS:
        return ["!"] * _NATURAL_FILLER_TOKENS, "!"
    if quality is Quality.STALE_PREFIX_CACHE:
        return ["4", "2"], " 42"
    if _QUESTION.search(prompt):
        return ["7"], ""
    return list(_filler(model, prompt)), ""


def plan_tokens(
    prompt: str, *, max_tokens: int | None, ignore_eos: bool, quality: Quality,
    model: str = "",
) -> TokenPlan:
    """The tokens a generation produces and how it finishes: a function of (model, prompt,
    max_tokens, ignore_eos) and the engine's quality, nothing else (greedy decoding)."""
    natural, pad = _natural(prompt, quality, model)
    if ignore_eos:
        wanted = max_tokens if max_tokens is not None else DEFAULT_IGNORE_EOS_TOKENS
        filler = _filler(model, prompt)
        padding = itertools.repeat(pad) if pad else itertools.cycle(filler)
        tokens = list(itertools.islice(itertools.chain(natural, padding), wanted))
        return TokenPlan(tuple(tokens), "length")
    if max_tokens is not None and len(natural) > max_tokens:
        return TokenPlan(tuple(natural[:max_tokens]), "length")
    return TokenPlan(tuple(natural), "stop")
