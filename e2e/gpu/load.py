"""Traffic the benchmarks send to an engine directly: throughput rounds, one long stream.

Both speak the OpenAI completions API as vLLM and the engine simulator serve it;
``ignore_eos`` forces the output length (a vLLM sampling parameter the simulator honours).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["LongStream", "output_throughput"]

PROMPT = "Tell a long story about a GPU that takes turns."


class LoadError(RuntimeError):
    """A request of the traffic did not succeed."""


async def output_throughput(session: aiohttp.ClientSession, base_url: str, model: str, *,
                            concurrency: int, rounds: int, max_tokens: int, timeout_s: float
                            ) -> dict[str, Any]:
    """Output tokens/s of ``rounds`` rounds of ``concurrency`` forced-length completions
    (the reference experiment: 8 x 2 x 128 tokens)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
            "stream": False, "temperature": 0}
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one() -> int:
        async with session.post(base_url + "/v1/completions", json=body,
                                timeout=timeout) as resp:
            if resp.status != 200:
                raise LoadError(f"completion answered {resp.status}: "
                                f"{(await resp.text())[:200]}")
            answer = await resp.json()
            return int(answer["usage"]["completion_tokens"])

    tokens = 0
    per_round: list[float] = []
    began = time.perf_counter()
    for _ in range(rounds):
        start = time.perf_counter()
        tokens += sum(await asyncio.gather(*(one() for _ in range(concurrency))))
        per_round.append(round(time.perf_counter() - start, 4))
    elapsed = time.perf_counter() - began
    return {"tokens": tokens, "seconds": round(elapsed, 4), "round_seconds": per_round,
            "tokens_per_s": round(tokens / elapsed, 2) if elapsed > 0 else None,
            "concurrency": concurrency, "rounds": rounds, "max_tokens": max_tokens}


@dataclass
class LongStream:
    """One long streamed completion running in the background (a sleep must wait for it)."""

    session: aiohttp.ClientSession
    base_url: str
    model: str
    max_tokens: int
    timeout_s: float
    chunks: int = 0
    status: int | None = None
    error: str | None = None
    started: float = 0.0
    first_token: float | None = None
    ended: float | None = None
    events: list[str] = field(default_factory=list)
    task: asyncio.Task[None] | None = None
    flowing: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at the first token (or when the stream ended without one)."""

    def start(self) -> None:
        self.started = time.monotonic()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        body = {"model": self.model, "prompt": PROMPT, "max_tokens": self.max_tokens,
                "ignore_eos": True, "stream": True, "temperature": 0}
        try:
            async with self.session.post(self.base_url + "/v1/completions", json=body,
                                         timeout=aiohttp.ClientTimeout(total=self.timeout_s)
                                         ) as resp:
                self.status = resp.status
                async for raw in resp.content:
                    line = raw.decode("utf-8", errors="replace").strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    try:
                        chunk = json.loads(data)
                    except ValueError:
                        continue
                    if isinstance(chunk, dict) and chunk.get("error") is not None:
                        self.error = json.dumps(chunk["error"])[:300]
                        break
                    self.chunks += 1
                    if self.first_token is None:
                        self.first_token = time.monotonic()
                        self.flowing.set()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            self.error = f"{type(exc).__name__}: {exc}"[:300]
        finally:
            self.ended = time.monotonic()
            self.flowing.set()

    async def wait(self, timeout_s: float) -> bool:
        """Until the stream ended (True) or ``timeout_s`` passed (False)."""
        if self.task is None:
            return True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout_s)
        except TimeoutError:
            return False
        return True

    async def cancel(self) -> None:
        if self.task is not None and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except asyncio.CancelledError:
                pass

    def as_dict(self) -> dict[str, Any]:
        return {"max_tokens": self.max_tokens, "status": self.status, "chunks": self.chunks,
                "error": self.error,
                "seconds": None if self.ended is None else round(self.ended - self.started, 3),
                "tokens_per_s": (round(self.chunks / (self.ended - self.first_token), 1)
                                 if self.ended and self.first_token and
                                 self.ended > self.first_token else None)}
