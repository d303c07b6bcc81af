"""Requests kept across a sleep, on one real engine (``python -m e2e.gpu.keep_probe``).

A preemptive switch puts the holder to sleep with its in-flight requests kept (vLLM's
``mode=keep``: the scheduler is set to ``PAUSED_ALL``, the running requests are preempted
by ``reset_prefix_cache(reset_running_requests=True)`` and recomputed after the wake) and
wakes it later. This probe settles, on one engine of ``--model``, which call sequence does
that correctly and what a kept stream looks like to its client:

1. **reference**: ``--streams`` greedy streams (temperature 0, ``ignore_eos``, fixed
   ``--max-tokens``) on an engine never slept since its start, plus the request that the
   next phase sends while asleep and the cycles' short streams, each alone;
2. **sequences** (``--sequences``): the same streams, put to sleep after their
   ``--preempt-after``-th token, left asleep ``--asleep-s``, woken (and resumed where the
   sequence says so), one request sent while asleep. ``A``: ``/sleep?level=1&mode=keep``,
   ``/wake_up``. ``B``: ``/pause?mode=keep``, ``/sleep?level=1`` (its default mode,
   ``abort``), ``/wake_up``, ``/resume``. ``B2``: as B with ``/sleep?level=1&mode=keep`` (what
   stays right if ``/sleep`` stops handling requests, vLLM RFC #51476);
3. **cycles**: ``--cycles`` level-1 sleep/wake cycles with the first sequence of phase 2
   that kept every stream intact (``--cycle-sequence``), every ``--stream-every``-th
   starting a short greedy stream that its sleep freezes, or freezing the one still
   running (every later sleep freezes it again until it ends: cycles never wait for it);
   the awake and asleep footprints, the cycle's seconds and the seconds of its NVML reads
   per cycle.

Every stream asks for ``logprobs`` and ``return_token_ids`` so each SSE chunk's tokens are
counted (a chunk may carry several tokens: vLLM's output collector merges deltas when the
engine gets ahead of the server), and for ``stream_options.include_usage`` (the engine's own
count). Per stream: text identical to its reference, tokens, chunks, chunks holding more than
one token, the longest gap between chunks. Per sequence: each call's duration and answer,
``/is_sleeping``/``/is_paused`` asleep and after the wake, whether tokens flowed after
``/wake_up`` before ``/resume``, the engine's running/waiting gauges before the sleep, asleep
and after the wake, and NVML used memory awake and asleep (the engine's processes where
NVML attributes them, else the device).

Within ``--budget-s`` (engine start included), stopping cleanly and writing what it has.
``--out``: one JSON, rewritten after every phase (and every 50 cycles); a table on stdout,
the JSON headline as the last line. ``--launcher simulator --fake-nvml h200`` runs it on
the engine simulator (no GPU; the simulator sends token ids too, so its chunks are counted
by them as a real engine's are).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from driver.devices import discover
from driver.nvml import open_backend
from driver.nvml.api import NvmlBackend
from e2e.gpu.context import MIB, REPO_ROOT
from e2e.gpu.engine_args import add_engine_arguments
from e2e.gpu.engines import (
    EngineProcess,
    EngineSpec,
    Launcher,
    SimulatorLauncher,
    VllmLauncher,
)
from e2e.gpu.steps import say
from rota.kit.engine_connections import engine_connector

__all__ = ["SEQUENCES", "CallSequence", "StreamRecord", "main", "parser"]

GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting",
          "vllm:num_preemptions_total")
PROMPTS = (
    "Write a long story about a lighthouse keeper who finds a map.",
    "Explain in detail how a steam engine works, step by step.",
    "List the history of the printing press and its effects on Europe.",
    "Describe a walk through a busy market in a coastal town at dawn.",
    "Give a recipe for bread and explain why each step matters.",
    "Tell the story of a ship lost in fog and the crew that found it.",
    "Explain how rivers shape valleys over thousands of years.",
    "Describe the life of a honey bee from egg to forager.",
)
ASLEEP_PROMPT = "Summarise the rules of chess for a child who has never played."
RESERVE_S = 20.0
"""Seconds kept back from the budget to stop the engine and write the results."""


@dataclass(frozen=True)
class CallSequence:
    """The control calls of one way to keep requests across a sleep."""

    name: str
    sleep: tuple[str, ...]
    wake: tuple[str, ...]
    resume: tuple[str, ...] = ()


SEQUENCES = {
    "A": CallSequence("A", ("/sleep?level=1&mode=keep",), ("/wake_up",)),
    "B": CallSequence("B", ("/pause?mode=keep", "/sleep?level=1"), ("/wake_up",),
                      ("/resume",)),
    "B2": CallSequence("B2", ("/pause?mode=keep", "/sleep?level=1&mode=keep"), ("/wake_up",),
                       ("/resume",)),
}
"""A: sleep with keep alone. B: pause with keep, then a plain sleep (vLLM's default mode
is abort). B2: pause with keep, then a sleep with keep (right today and under RFC #51476)."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m e2e.gpu.keep_probe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_arguments(p, model_help="the folder under --models")
    add = p.add_argument
    add("--streams", type=int, default=4, help="concurrent streams kept by each sequence")
    add("--max-tokens", type=int, default=160)
    add("--preempt-after", type=int, default=40,
        help="put the engine to sleep once every stream has this many tokens")
    add("--asleep-s", type=float, default=2.0)
    add("--sequences", default="A,B,B2", help=f"of {', '.join(SEQUENCES)}, in this order")
    add("--cycles", type=int, default=1000)
    add("--stream-every", type=int, default=4,
        help="every this many cycles, a short stream started and frozen by the sleep, or "
             "the one still running frozen again (0: none)")
    add("--cycle-max-tokens", type=int, default=64)
    add("--cycle-sequence", default="auto",
        help="the cycles' sequence; auto: the first of B2, A, B that kept every stream")
    add("--budget-s", type=float, default=480.0, help="seconds for everything, start included")
    add("--out", type=Path, default=Path("keep.json"))
    add("--state-dir", type=Path, default=None)
    add("--start-timeout-s", type=float, default=300.0)
    add("--control-timeout-s", type=float, default=120.0)
    add("--stream-timeout-s", type=float, default=120.0)
    return p


# -- streams ---------------------------------------------------------------------------------

@dataclass
class StreamRecord:
    """One streamed completion as its client saw it."""

    prompt: str
    max_tokens: int
    started: float = field(default_factory=time.monotonic)
    text: list[str] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    counted_by: str = "chunks"
    usage_tokens: int | None = None
    finish: str | None = None
    status: int | None = None
    error: str | None = None
    done: bool = False

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)

    def max_gap_s(self) -> float:
        marks = [self.started, *self.times]
        return max((b - a for a, b in itertools.pairwise(marks)), default=0.0)

    def summary(self, reference: StreamRecord | None) -> dict[str, Any]:
        return {"tokens": self.tokens, "usage_tokens": self.usage_tokens,
                "chunks": len(self.chunk_tokens),
                "multi_token_chunks": sum(1 for n in self.chunk_tokens if n > 1),
                "most_tokens_in_a_chunk": max(self.chunk_tokens, default=0),
                "counted_by": self.counted_by, "finish": self.finish, "status": self.status,
                "error": self.error, "max_gap_s": round(self.max_gap_s(), 3),
                "identical": None if reference is None else self.same_as(reference),
                "reference_tokens": None if reference is None else reference.tokens}

    def same_as(self, reference: StreamRecord) -> bool:
        if self.error or not self.done:
            return False
        if self.token_ids and reference.token_ids and self.token_ids != reference.token_ids:
            return False
        return "".join(self.text) == "".join(reference.text)


class Progress:
    """Wakes waiters on every chunk of any stream (waits are on conditions, bounded)."""

    def __init__(self) -> None:
        self._changed = asyncio.Condition()

    async def tick(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, timeout_s)), self._changed:
                await self._changed.wait_for(predicate)
        return predicate()


def _chunk_tokens(choice: dict[str, Any], rec: StreamRecord) -> int:
    """Tokens in one chunk: its token ids, else its logprobs' tokens, else one per text."""
    ids = choice.get("token_ids")
    if isinstance(ids, list):
        rec.counted_by = "token_ids"
        rec.token_ids.extend(int(i) for i in ids)
        return len(ids)
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        rec.counted_by = "logprobs"
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0


def _take(rec: StreamRecord, data: dict[str, Any]) -> bool:
    """One SSE payload into the record; True when it carried tokens."""
    if "error" in data:
        rec.error = str(data["error"])[:300]
        return False
    usage = data.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        rec.usage_tokens = int(usage["completion_tokens"])
    carried = False
    for choice in data.get("choices") or []:
        n = _chunk_tokens(choice, rec)
        if n or choice.get("text"):
            rec.text.append(choice.get("text") or "")
            rec.chunk_tokens.append(n)
            rec.times.append(time.monotonic())
            carried = True
        rec.finish = choice.get("finish_reason") or rec.finish
    return carried


async def stream(session: aiohttp.ClientSession, base: str, model: str, rec: StreamRecord,
                 progress: Progress, timeout_s: float) -> StreamRecord:
    """Stream one greedy completion into ``rec``; never raises (errors are recorded)."""
    body = {"model": model, "prompt": rec.prompt, "max_tokens": rec.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": 1,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    rec.started = time.monotonic()
    try:
        async with session.post(base + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"{resp.status}: {(await resp.text())[:300]}"
                return rec
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    rec.done = True
                    break
                with contextlib.suppress(ValueError):
                    if _take(rec, json.loads(payload)):
                        await progress.tick()
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {str(exc)[:200]}"
    finally:
        rec.done = rec.done and rec.error is None
        await progress.tick()
    return rec


# -- the engine's side -----------------------------------------------------------------------

@dataclass
class Probe:
    """One engine, its HTTP session, the GPU's NVML and the run's deadline."""

    engine: EngineProcess
    session: aiohttp.ClientSession
    backend: NvmlBackend
    gpu_index: int
    args: argparse.Namespace
    deadline: float
    progress: Progress = field(default_factory=Progress)

    @property
    def base(self) -> str:
        return self.engine.record.base_url

    @property
    def model(self) -> str:
        return self.engine.record.spec.served_name

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    async def call(self, path: str, method: str = "POST") -> dict[str, Any]:
        """One control call: its status, answer (cut) and seconds."""
        began = time.monotonic()
        timeout = aiohttp.ClientTimeout(total=min(self.args.control_timeout_s,
                                                  max(5.0, self.remaining())))
        try:
            async with self.session.request(method, self.base + path, timeout=timeout) as r:
                text = await r.text()
                return {"path": path, "status": r.status, "answer": text[:300],
                        "seconds": round(time.monotonic() - began, 4)}
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return {"path": path, "status": None, "answer": f"{type(exc).__name__}: {exc}",
                    "seconds": round(time.monotonic() - began, 4)}

    async def gauges(self) -> dict[str, float]:
        """The engine's request gauges (summed over label sets), from ``/metrics``."""
        found: dict[str, float] = {}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, OSError):
            async with self.session.get(self.base + "/metrics",
                                        timeout=aiohttp.ClientTimeout(total=10)) as r:
                for line in (await r.text()).splitlines():
                    name = line.split("{", 1)[0].split(" ", 1)[0]
                    if name in GAUGES:
                        with contextlib.suppress(ValueError, IndexError):
                            found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return found

    def memory(self) -> dict[str, Any]:
        """NVML used memory: the device's, and the engine's processes' where NVML names them."""
        try:
            info, procs = self.backend.memory_and_processes(self.gpu_index)
        except Exception as exc:  # an NVML hiccup is recorded, not fatal
            return {"device_used_mib": None, "engine_mib": None, "error": str(exc)[:200]}
        pids = set(self.engine.group())
        mine = [p.used_bytes or 0 for p in procs if p.pid in pids]
        return {"device_used_mib": round(info.used / MIB, 1),
                "engine_mib": round(sum(mine) / MIB, 1) if mine else None}

    def start_streams(self, prompts: Sequence[str], max_tokens: int
                      ) -> tuple[list[StreamRecord], list[asyncio.Task[StreamRecord]]]:
        recs = [StreamRecord(p, max_tokens) for p in prompts]
        tasks = [asyncio.create_task(stream(self.session, self.base, self.model, r,
                                            self.progress, self.args.stream_timeout_s))
                 for r in recs]
        return recs, tasks


def footprint(mem: dict[str, Any]) -> float | None:
    """The engine's own MiB where NVML attributes them, else the device's used MiB."""
    return mem.get("engine_mib") if mem.get("engine_mib") is not None else \
        mem.get("device_used_mib")


# -- phases ----------------------------------------------------------------------------------

async def references(probe: Probe, result: dict[str, Any]) -> dict[str, StreamRecord]:
    """Streams on the never-slept engine: the kept batch together, the others alone."""
    args = probe.args
    say(f"== reference: {args.streams} streams of {args.max_tokens} tokens")
    refs: dict[str, StreamRecord] = {}
    recs, tasks = probe.start_streams(_batch(args), args.max_tokens)
    await asyncio.gather(*tasks)
    refs.update({f"batch:{r.prompt}": r for r in recs})
    for prompt, tokens in [(ASLEEP_PROMPT, 32)] + [(p, args.cycle_max_tokens)
                                                   for p in _cycle_prompts()]:
        (alone,), (task,) = probe.start_streams([prompt], tokens)
        await task
        refs[f"alone:{prompt}:{tokens}"] = alone
    result["reference"] = {k: r.summary(None) for k, r in refs.items()}
    return refs


def _batch(args: argparse.Namespace) -> list[str]:
    return [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})")
            for i in range(args.streams)]


def _cycle_prompts() -> tuple[str, ...]:
    return PROMPTS[:4]


async def keep_once(probe: Probe, seq: CallSequence, refs: dict[str, StreamRecord]
                    ) -> dict[str, Any]:
    """The batch kept across one sleep with ``seq``; what came back, and every call."""
    args = probe.args
    out: dict[str, Any] = {"sequence": seq.name, "calls": [], "memory": {}, "gauges": {}}
    out["memory"]["awake_before"] = probe.memory()
    recs, tasks = probe.start_streams(_batch(args), args.max_tokens)
    reached = await probe.progress.wait_for(
        lambda: all(r.tokens >= args.preempt_after or r.done or r.error for r in recs),
        min(60.0, probe.remaining()))
    out["tokens_at_sleep"] = [r.tokens for r in recs]
    out["reached_preempt_point"] = reached
    out["gauges"]["before_sleep"] = await probe.gauges()
    for path in seq.sleep:
        out["calls"].append(await probe.call(path))
    asleep_at = time.monotonic()
    out["memory"]["asleep"] = probe.memory()
    out["is_sleeping_asleep"] = (await probe.call("/is_sleeping", "GET"))["answer"]
    out["is_paused_asleep"] = (await probe.call("/is_paused", "GET"))["answer"]
    out["gauges"]["asleep"] = await probe.gauges()
    frozen = [r.tokens for r in recs]
    (late,), (late_task,) = probe.start_streams([ASLEEP_PROMPT], 32)
    await probe.progress.wait_for(lambda: False, args.asleep_s - (time.monotonic() - asleep_at))
    out["moved_while_asleep"] = [r.tokens - f for r, f in zip(recs, frozen, strict=True)]
    out["asleep_request_held"] = not late.chunk_tokens and late.error is None
    for path in seq.wake:
        out["calls"].append(await probe.call(path))
    woke = [r.tokens for r in recs]
    out["is_paused_after_wake"] = (await probe.call("/is_paused", "GET"))["answer"]
    out["gauges"]["after_wake"] = await probe.gauges()
    if seq.resume:  # does /wake_up alone let the kept requests run?
        out["tokens_before_resume"] = await probe.progress.wait_for(
            lambda: any(r.tokens > w for r, w in zip(recs, woke, strict=True)), 3.0)
        for path in seq.resume:
            out["calls"].append(await probe.call(path))
    await asyncio.gather(*tasks, late_task)
    out["memory"]["awake_after"] = probe.memory()
    out["gauges"]["after_streams"] = await probe.gauges()
    out["streams"] = [r.summary(refs.get(f"batch:{r.prompt}")) for r in recs]
    out["asleep_request"] = late.summary(refs.get(f"alone:{ASLEEP_PROMPT}:32"))
    out["identical"] = sum(1 for s in out["streams"] if s["identical"])
    out["correct"] = (out["identical"] == len(recs) and bool(out["asleep_request"]["identical"])
                      and all(c["status"] == 200 for c in out["calls"]))
    return out


def cycle_sequence(args: argparse.Namespace, tried: Sequence[dict[str, Any]]) -> tuple[str, str]:
    """The cycles' sequence and why: the flag, or the first of B2, A, B phase 2 found correct."""
    if args.cycle_sequence != "auto":
        return args.cycle_sequence, "--cycle-sequence"
    correct = {t["sequence"] for t in tried if t.get("correct")}
    for name in ("B2", "A", "B"):
        if name in correct:
            return name, "kept every stream intact in the sequences phase"
    return "A", "no sequence kept every stream intact (or none ran): A"


async def cycles(probe: Probe, seq: CallSequence, refs: dict[str, StreamRecord],
                 result: dict[str, Any], write: Callable[[], None]) -> None:
    """Level-1 sleep/wake cycles, every ``--stream-every``-th starting a short stream that
    its sleep freezes mid-decode. A stream is never waited for: it decodes through the next
    cycles and is frozen again by every sleep it is still running at, and a cycle due to
    start one while the last still runs freezes that one instead (one stream at a time).
    So cycles go at the pace of the calls and reads (a 64-token stream of an eager engine
    outlasts several cycles), at least every ``--stream-every``-th freezes a stream, and
    each stream is checked against its reference once it ended."""
    args = probe.args
    rows: list[list[Any]] = []
    frozen: list[dict[str, Any]] = []
    result["cycles"] = {"sequence": seq.name, "columns": [
        "cycle", "sleep_s", "wake_s", "asleep_mib", "awake_mib", "stream_identical",
        "cycle_s", "read_s", "froze_a_stream"], "rows": rows, "frozen": frozen}
    prompts = _cycle_prompts()
    running: _CycleStream | None = None

    async def collect() -> None:
        nonlocal running
        if running is None:
            return
        rec = await running.task
        summary = rec.summary(refs.get(f"alone:{rec.prompt}:{args.cycle_max_tokens}"))
        running.row[5] = bool(summary["identical"])
        frozen.append({"cycle": running.row[0], "freezes": running.freezes} | summary)
        running = None

    for i in range(args.cycles):
        if probe.remaining() < RESERVE_S + 10.0:
            result["cycles"]["stopped"] = f"budget: {i} of {args.cycles} cycles"
            break
        began = time.monotonic()
        row: list[Any] = [i, 0.0, 0.0, None, None, None, 0.0, 0.0, False]
        if running is not None and running.task.done():
            await collect()
        if args.stream_every and i % args.stream_every == 0 and running is None:
            prompt = prompts[(i // args.stream_every) % len(prompts)]
            (rec,), (task,) = probe.start_streams([prompt], args.cycle_max_tokens)
            running = _CycleStream(task, row)
            first = min(8, max(1, args.cycle_max_tokens // 4))
            await probe.progress.wait_for(_has_tokens(rec, first), 30.0)
        if running is not None and not running.task.done():
            running.freezes += 1
            row[8] = True
        sleep_calls = [await probe.call(p) for p in seq.sleep]
        read_began = time.monotonic()
        asleep = footprint(probe.memory())
        read_s = time.monotonic() - read_began
        wake_calls = [await probe.call(p) for p in seq.wake + seq.resume]
        read_began = time.monotonic()
        awake = footprint(probe.memory())
        read_s += time.monotonic() - read_began
        row[1:5] = [round(sum(c["seconds"] for c in sleep_calls), 4),
                    round(sum(c["seconds"] for c in wake_calls), 4), asleep, awake]
        row[6:8] = [round(time.monotonic() - began, 4), round(read_s, 4)]
        rows.append(row)
        if not all(c["status"] == 200 for c in sleep_calls + wake_calls):
            result["cycles"]["stopped"] = f"cycle {i}: {sleep_calls + wake_calls}"
            break
        if i % 50 == 49:
            result["cycles"]["summary"] = cycle_summary(rows, frozen)
            write()
    await collect()
    result["cycles"]["summary"] = cycle_summary(rows, frozen)


@dataclass
class _CycleStream:
    """The cycles' stream in flight: its task, the row of the cycle that started it, and
    how many sleeps have frozen it so far."""

    task: asyncio.Task[StreamRecord]
    row: list[Any]
    freezes: int = 0


def _has_tokens(rec: StreamRecord, n: int) -> Callable[[], bool]:
    """The stream has ``n`` tokens or ended: frozen mid-decode, not before its prefill."""
    return lambda: rec.tokens >= n or rec.done or rec.error is not None


def cycle_summary(rows: Sequence[Sequence[Any]], frozen: Sequence[dict[str, Any]]
                  ) -> dict[str, Any]:
    """First against last footprints, the largest drift from the first, the frozen streams."""
    def drift(col: int) -> dict[str, Any]:
        vals = [r[col] for r in rows if r[col] is not None]
        if not vals:
            return {"first": None, "last": None, "max_drift_pct": None}
        first = vals[0]
        worst = max((abs(v - first) / first * 100 for v in vals), default=0.0) if first else None
        return {"first": first, "last": vals[-1],
                "max_drift_pct": None if worst is None else round(worst, 3)}

    sleeps = sorted(r[1] for r in rows)
    wakes = sorted(r[2] for r in rows)
    return {"cycles": len(rows), "asleep_mib": drift(3), "awake_mib": drift(4),
            "sleep_s_p50": _median(sleeps), "wake_s_p50": _median(wakes),
            "sleep_s_max": sleeps[-1] if sleeps else None,
            "wake_s_max": wakes[-1] if wakes else None,
            "cycle_s_p50": _median(sorted(r[6] for r in rows)),
            "read_s_p50": _median(sorted(r[7] for r in rows)),
            "most_freezes_of_a_stream": max((f["freezes"] for f in frozen), default=0),
            "cycles_freezing_a_stream": sum(1 for r in rows if r[8]),
            "frozen_streams": len(frozen),
            "frozen_identical": sum(1 for f in frozen if f["identical"]),
            "frozen_with_all_chunks": sum(1 for f in frozen if f["chunks"] == f["tokens"]),
            "frozen_tokens_as_reference": sum(1 for f in frozen
                                              if f["tokens"] == f["reference_tokens"])}


def _median(values: Sequence[float]) -> float | None:
    return values[len(values) // 2] if values else None


# -- the run ---------------------------------------------------------------------------------

def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, default=str, indent=1), encoding="utf-8")
    tmp.replace(path)


def _spec(args: argparse.Namespace) -> EngineSpec:
    return EngineSpec(key="keep", model_dir=args.models / args.model, served_name="keep/m0",
                      kv_cache_bytes=args.kv, max_num_seqs=args.max_seqs,
                      max_model_len=args.max_model_len,
                      gpu_memory_utilization=args.gpu_memory_utilization)


def _launcher(args: argparse.Namespace, gpu_uuid: str, gpu_index: int) -> Launcher:
    env = {k: v for k, v in os.environ.items() if k not in ("ROTA_CLAIM_UID", "ROTA_POD_UID")}
    if args.launcher == "vllm":
        env |= {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": str(gpu_index)}
        return VllmLauncher(python=args.vllm_python, pythonpath=args.vllm_pythonpath,
                            base_env=env)
    return SimulatorLauncher(python=sys.executable, repo_root=REPO_ROOT,
                             fake_nvml_dir=args.state_dir / "nvml", gpu_uuid=gpu_uuid,
                             base_env=env, tokens_per_second=args.tokens_per_second)


async def _phases(probe: Probe, result: dict[str, Any], write: Callable[[], None]) -> None:
    args = probe.args
    refs = await references(probe, result)
    write()
    tried: list[dict[str, Any]] = []
    result["sequences"] = tried
    for name in args.sequences.split(","):
        if probe.remaining() < RESERVE_S + 30.0:
            result["sequences_stopped"] = f"budget: before {name}"
            break
        say(f"== sequence {name}: {' '.join(SEQUENCES[name].sleep)} | "
            f"{' '.join(SEQUENCES[name].wake + SEQUENCES[name].resume)}")
        tried.append(await keep_once(probe, SEQUENCES[name], refs))
        write()
    name, why = cycle_sequence(args, tried)
    result["cycle_sequence"] = {"name": name, "why": why}
    if args.cycles > 0:
        say(f"== {args.cycles} cycles with {name} ({why}), {probe.remaining():.0f} s left")
        await cycles(probe, SEQUENCES[name], refs, result, write)


async def _run(args: argparse.Namespace, result: dict[str, Any], deadline: float) -> None:
    backend = open_backend(args.fake_nvml, args.state_dir / "nvml")
    backend.init()
    engine: EngineProcess | None = None
    try:
        gpu = next((g for g in discover(backend) if g.index == args.gpu_index), None)
        if gpu is None:
            raise RuntimeError(f"no usable GPU with NVML index {args.gpu_index}")
        result["device"] = gpu.product_name
        spec = _spec(args)
        engine = EngineProcess.start(spec, _launcher(args, gpu.uuid, gpu.index), args.state_dir)
        (args.state_dir / "state.json").write_text(json.dumps(
            {"engines": {spec.key: engine.record.model_dump(mode="json")}}), encoding="utf-8")
        async with aiohttp.ClientSession(connector=engine_connector(limit=0)) as session:
            say(f"starting one engine of {args.model} ({args.launcher}) on {gpu.product_name}")
            ready = await engine.wait_ready(session, deadline=min(
                deadline - RESERVE_S, time.monotonic() + args.start_timeout_s))
            result["engine"] = {"ready_s": round(ready, 2), "launcher": args.launcher}
            probe = Probe(engine, session, backend, gpu.index, args, deadline)

            def write() -> None:
                write_json(args.out, result)

            await _phases(probe, result, write)
    finally:
        if engine is not None:
            result.setdefault("engine", {})["stop_killed"] = engine.stop(10.0)
        with contextlib.suppress(Exception):
            backend.shutdown()


def _f(v: object) -> str:
    if isinstance(v, float):
        return "-" if math.isnan(v) else f"{v:.2f}"
    return "-" if v is None else str(v)


def table(result: dict[str, Any]) -> str:
    lines = ["| sequence | identical | tokens (ref) | chunks | multi-token chunks | longest gap s "
             "| sleep calls s | wake calls s | asleep MiB | awake MiB | asleep request |",
             "|" + "---|" * 11]
    for s in result.get("sequences", []):
        streams = s.get("streams", [])
        calls = s.get("calls", [])
        n_sleep = len(SEQUENCES[s["sequence"]].sleep)
        late = s.get("asleep_request", {})
        lines.append("| " + " | ".join(_f(v) for v in (
            s["sequence"], f"{s.get('identical')}/{len(streams)}",
            ",".join(f"{x['tokens']}({x['reference_tokens']})" for x in streams),
            ",".join(str(x["chunks"]) for x in streams),
            sum(x["multi_token_chunks"] for x in streams),
            max((x["max_gap_s"] for x in streams), default=None),
            round(sum(c["seconds"] for c in calls[:n_sleep]), 3),
            round(sum(c["seconds"] for c in calls[n_sleep:]), 3),
            footprint(s["memory"].get("asleep", {})),
            footprint(s["memory"].get("awake_after", {})),
            f"held {s.get('asleep_request_held')}, identical {late.get('identical')}")) + " |")
    summary = (result.get("cycles") or {}).get("summary")
    if summary:
        lines.append("")
        lines.append(f"cycles ({result['cycles']['sequence']}): {summary['cycles']}, asleep MiB "
                     f"{summary['asleep_mib']}, awake MiB {summary['awake_mib']}, frozen streams "
                     f"identical {summary['frozen_identical']}/{summary['frozen_streams']}, "
                     f"with one chunk per token {summary['frozen_with_all_chunks']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.launcher == "simulator" and not args.fake_nvml:
        p.error("--launcher simulator needs --fake-nvml")
    unknown = [s for s in args.sequences.split(",") if s not in SEQUENCES]
    if unknown or args.cycle_sequence not in (*SEQUENCES, "auto"):
        p.error(f"--sequences / --cycle-sequence: of {', '.join(SEQUENCES)} (or auto)")
    began = time.monotonic()
    args.state_dir = args.state_dir or Path(os.environ.get("TMPDIR", "/tmp")) / \
        f"rota-keep-probe-{uuid.uuid4().hex[:8]}"
    args.state_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "benchmark": "keep_probe", "launcher": args.launcher, "model": args.model,
        "settings": {k: getattr(args, k) for k in (
            "streams", "max_tokens", "preempt_after", "asleep_s", "sequences", "cycles",
            "stream_every", "cycle_max_tokens", "budget_s")},
        "sequences_defined": {k: {"sleep": v.sleep, "wake": v.wake, "resume": v.resume}
                              for k, v in SEQUENCES.items()}}
    error: str | None = None
    try:
        asyncio.run(_run(args, result, began + args.budget_s))
    except Exception as exc:
        error = f"{type(exc).__name__}: {str(exc)[:3000]}"
    result["error"] = error
    result["wall_s"] = round(time.monotonic() - began, 2)
    write_json(args.out, result)
    print()
    print(table(result))
    if error:
        print(f"ERROR: {error}")
    print(json.dumps({"ok": error is None, "error": error, "device": result.get("device"),
                      "correct": {s["sequence"]: s["correct"]
                                  for s in result.get("sequences", [])},
                      "cycle_sequence": (result.get("cycle_sequence") or {}).get("name"),
                      "cycles": ((result.get("cycles") or {}).get("summary") or {}),
                      "wall_s": result["wall_s"]}))
    return 0 if error is None else 1


if __name__ == "__main__":
    raise SystemExit(main())
