"""Canned generations: which tokens a prompt gets, given the engine's state. Pure.

The one question with a right answer is rota's correctness probe, "3 + 4" (also "3 plus
4", any case): a healthy engine answers ``7``. Every other prompt gets deterministic
filler text. A broken engine gets it wrong the way real ones do:

- weights not reloaded after a level-2 wake: ``!!!!...`` (garbage weights);
- prefix cache not reset after a level-2 wake: ``42`` (a stale cached answer).

Without ``ignore_eos`` the natural answer ends with a stop (``finish_reason: stop``),
cut short by ``max_tokens`` (``length``). With ``ignore_eos`` the output is exactly
``max_tokens`` tokens, padded with filler, and ends with ``length``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Literal

from e2e.engine_simulator.state import Quality

__all__ = [
    "DEFAULT_IGNORE_EOS_TOKENS",
    "TokenPlan",
    "count_prompt_tokens",
    "plan_tokens",
]

DEFAULT_IGNORE_EOS_TOKENS = 256
"""Output length with ``ignore_eos`` and no ``max_tokens`` (a real engine runs to its context)."""

_QUESTION = re.compile(r"(?<!\d)3\s*(?:\+|plus)\s*4(?!\d)", re.IGNORECASE)
_FILLER = (" The", " simulated", " engine", " has", " nothing", " real", " to", " say",
           ",", " so", " it", " says", " this", " again", " and", " again", ".")
_NATURAL_FILLER_TOKENS = len(_FILLER)

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenPlan:
    tokens: tuple[str, ...]
    finish_reason: FinishReason


def count_prompt_tokens(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word, at least one."""
    return max(1, len(text.split()))


def _natural(prompt: str, quality: Quality) -> tuple[list[str], str]:
    """The answer the model wants to give, and the token it pads with."""
    if quality is Quality.GARBAGE_WEIGHTS:
        return ["!"] * _NATURAL_FILLER_TOKENS, "!"
    if quality is Quality.STALE_PREFIX_CACHE:
        return ["4", "2"], " 42"
    if _QUESTION.search(prompt):
        return ["7"], ""
    return list(_FILLER), ""


def plan_tokens(
    prompt: str, *, max_tokens: int | None, ignore_eos: bool, quality: Quality
) -> TokenPlan:
    """The tokens a generation streams, one per chunk, and how it finishes."""
    natural, pad = _natural(prompt, quality)
    if ignore_eos:
        wanted = max_tokens if max_tokens is not None else DEFAULT_IGNORE_EOS_TOKENS
        padding = itertools.repeat(pad) if pad else itertools.cycle(_FILLER)
        tokens = list(itertools.islice(itertools.chain(natural, padding), wanted))
        return TokenPlan(tuple(tokens), "length")
    if max_tokens is not None and len(natural) > max_tokens:
        return TokenPlan(tuple(natural[:max_tokens]), "length")
    return TokenPlan(tuple(natural), "stop")
