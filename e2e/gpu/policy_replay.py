"""One policy on real engines: a trace window replayed through the lease controller's own
GPU worker.

:func:`replay` builds what the lease controller builds for one GPU (a
:class:`~controller.lease.gpu.GpuWorker` with the node's default policy from
:class:`~controller.lease.settings.LeaseSettings`, ``--policy-mode`` included, and the
real :class:`~controller.lease.switch.Switcher`) on an in-memory GPU Lease, opens it and
runs it as the controller does. Each arrival of the window is a client that does what the
gateway does for a request: it asks for its model (``GpuWorker.activate``, the call the
activation API's handler ends in), and once the Lease names its model awake it streams
a completion to that engine and takes its first token; when the Lease settles with
another holder before that token (the engine was put to sleep and holds the request), the
request goes back to the activation, as the gateway's dispatch does. So the decisions
(``policy.decide`` called by the worker), the queueing, the drains, sleeps, wakes and
probes are the controller's own; only the Kubernetes API and the gateway's proxy are left
out.

A client leaves after ``client_timeout_s`` without a first token (its place in the
worker's queue goes with it, as a gateway's disconnect does); it then counts as not
served, its TTFT infinite.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from controller.claimants import Claimant
from controller.lease import metrics
from controller.lease.engines.base import EngineAdapter
from controller.lease.gpu import GpuWorker, Policy
from controller.lease.policy import RULES, PolicyMode
from controller.lease.settings import LeaseSettings
from controller.lease.switch import Switcher, SwitchResult
from e2e.bench.stats import percentile
from e2e.harness.ports import MemoryLeasePort
from rota.api import naming
from rota.api.gpu_lease import GpuLease

__all__ = ["Arrival", "ClientSettings", "Outcome", "PolicyRun", "RecordingSwitcher",
           "SwitchRecord", "replay", "rows"]


@dataclass(frozen=True)
class Arrival:
    at: float
    """Seconds from the window's start."""
    model: int
    context: int
    generated: int


@dataclass
class Outcome:
    arrival: Arrival
    ttft_s: float = math.inf
    """Arrival to the first streamed token (inf: never)."""
    done_s: float = math.inf
    """Arrival to the stream's end."""
    fence: int = 0
    """The Lease's fencing number it was served under: the holder's tenure."""
    attempts: int = 0
    """Times it was sent back: forwarded, then held by an engine put to sleep."""
    error: str = ""


@dataclass(frozen=True)
class SwitchRecord:
    at: float
    """Seconds from the window's start when the switch ended."""
    holder: str | None
    target: str
    ok: bool
    fence: int
    reason: str
    timings: dict[str, float]


class RecordingSwitcher(Switcher):
    """The controller's Switcher, unchanged, recording each switch it makes."""

    def __init__(self, *, records: list[SwitchRecord], clock: Callable[[], float],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records = records
        self.clock = clock
        self.origin = clock()

    async def switch(self, lease: GpuLease, *, holder: Claimant | None, target: Claimant,
                     claimants: Sequence[Claimant]) -> SwitchResult:
        result = await super().switch(lease, holder=holder, target=target,
                                      claimants=claimants)
        self.records.append(SwitchRecord(
            at=self.clock() - self.origin, holder=holder.ref if holder else None,
            target=target.ref, ok=result.ok, fence=result.lease.fence, reason=result.reason,
            timings=dict(result.timings)))
        return result


@dataclass(frozen=True)
class ClientSettings:
    client_timeout_s: float = 60.0
    max_context: int = 2048
    """Prompt tokens at most (the trace's context, capped to the engines' model length)."""
    max_generated: int = 512
    decode_bound_s: float = 300.0
    """Bound on a stream after its first token."""
    ttft_slo_s: float = 2.0


@dataclass
class PolicyRun:
    mode: PolicyMode
    outcomes: list[Outcome]
    switches: list[SwitchRecord]
    rules: dict[str, int]
    wall_s: float
    window_s: float
    models: list[str]
    slo_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def prompt_of(tokens: int) -> str:
    """A prompt of about ``tokens`` tokens: short common words, one token each in a
    byte-level BPE vocabulary (the test models' 4096-token one included)."""
    return "".join((" the", " and", " of", " to")[i % 4] for i in range(max(1, tokens)))


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                  first: asyncio.Event) -> None:
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"completion answered {resp.status}: "
                               f"{(await resp.text())[:200]}")
        async for line in resp.content:
            text = line.strip()
            if text.startswith(b"data:") and text != b"data: [DONE]" and not first.is_set():
                first.set()


def _moved_on(port: MemoryLeasePort, claimant: Claimant) -> bool:
    """The GPU's Lease has settled with another holder, or none: an engine put to sleep
    holds the requests it had not begun (the gateway's step 3 sends them back)."""
    lease = port.current
    return lease.holder != claimant.ref and lease.state in (naming.STATE_AWAKE,
                                                           naming.STATE_IDLE)


async def _first_token(stream: asyncio.Task[None], first: asyncio.Event,
                       port: MemoryLeasePort, claimant: Claimant) -> bool:
    """Until the first token (True), the stream's end without one, or the Lease moving on
    before it (False: the stream is cancelled)."""
    waiter = asyncio.create_task(first.wait())
    try:
        while not (first.is_set() or stream.done()):
            await asyncio.wait({stream, waiter}, timeout=0.02,
                               return_when=asyncio.FIRST_COMPLETED)
            if not first.is_set() and _moved_on(port, claimant):
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
                return False
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
    if not first.is_set():
        await stream  # raises what ended it
    return first.is_set()


async def _client(arrival: Arrival, out: Outcome, *, worker: GpuWorker, port: MemoryLeasePort,
                  claimant: Claimant, session: aiohttp.ClientSession, url: str,
                  client: ClientSettings, t0: float) -> None:
    """One request as the gateway carries it (controller/gateway/dispatch.py): ask for the
    model, forward once the Lease names it awake (with no lag: this gateway's view of the
    Lease is the Lease itself), and send it back to the activation when the Lease settles
    with another holder before its first token."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + arrival.at - loop.time()))
    began = loop.time()
    body = {"model": claimant.model, "prompt": prompt_of(min(arrival.context,
                                                             client.max_context)),
            "max_tokens": max(1, min(arrival.generated, client.max_generated)),
            "ignore_eos": True, "stream": True, "temperature": 0}
    first = asyncio.Event()
    stream: asyncio.Task[None] | None = None
    try:
        async with asyncio.timeout(client.client_timeout_s):
            while not first.is_set():
                answer = await worker.activate(claimant)
                if not answer.ok:
                    out.error = answer.reason or "refused"
                    return
                lease = port.current
                if lease.holder != claimant.ref or lease.state != naming.STATE_AWAKE:
                    await asyncio.sleep(0.005)
                    continue
                out.fence = lease.fence
                stream = asyncio.create_task(_stream(session, url, body, first))
                if not await _first_token(stream, first, port, claimant):
                    out.attempts += 1
            out.ttft_s = loop.time() - began
    except TimeoutError:
        out.error = out.error or "client_timeout"
    except (aiohttp.ClientError, RuntimeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    if stream is not None:
        if first.is_set():
            try:
                await asyncio.wait_for(stream, client.decode_bound_s)
                out.done_s = loop.time() - began
            except (TimeoutError, aiohttp.ClientError, RuntimeError, OSError) as exc:
                out.error = f"after its first token: {type(exc).__name__}"
        else:
            stream.cancel()
            await asyncio.gather(stream, return_exceptions=True)


def _rules_now() -> dict[str, float]:
    return {r: metrics.REGISTRY.get_sample_value("rota_controller_policy_decisions_total",
                                                 {"rule": r}) or 0.0 for r in RULES}


async def replay(*, mode: PolicyMode, arrivals: Sequence[Arrival], claimants: Sequence[Claimant],
                 gpu: str, port: MemoryLeasePort, switcher: RecordingSwitcher,
                 engine: Callable[[Claimant], EngineAdapter], session: aiohttp.ClientSession,
                 client: ClientSettings, window_s: float) -> PolicyRun:
    """Replay ``arrivals`` (model index into ``claimants``) through a fresh GPU worker whose
    node-wide policy mode is ``mode``; every engine asleep and ``port`` idle at the start."""
    settings = LeaseSettings(node_name="policy-run", policy_mode=mode)
    loop = asyncio.get_running_loop()
    worker = GpuWorker(
        gpu=gpu, lease_port=port, switcher=switcher,  # type: ignore[arg-type]
        claimants=lambda: list(claimants), engine=engine, clock=loop.time,
        identity="policy-run",
        policy=Policy(min_residency_s=settings.min_residency_s,
                      idle_sleep_s=settings.idle_sleep_s,
                      coalesce_window_s=settings.coalesce_window_s, resync_s=settings.resync_s,
                      tolerance_bytes=settings.resident_tolerance_bytes,
                      models=settings.model_policy(), home_model=settings.home_model,
                      home_idle_s=settings.home_idle_s))
    stop = asyncio.Event()
    rules_before = _rules_now()
    worker.open()
    runner = asyncio.create_task(worker.run(stop), name=f"policy-run-{gpu}")
    outcomes = [Outcome(a) for a in arrivals]
    t0 = loop.time() + 0.5
    switcher.origin = t0
    try:
        clients = [asyncio.create_task(_client(
            a, out, worker=worker, port=port, claimant=claimants[a.model], session=session,
            url=f"{claimants[a.model].endpoint}/v1/completions", client=client, t0=t0))
            for a, out in zip(arrivals, outcomes, strict=True)]
        await asyncio.gather(*clients)
    finally:
        wall = loop.time() - t0
        stop.set()
        worker.close("stopping", "the replay is over")
        await asyncio.gather(runner, return_exceptions=True)
    after = _rules_now()
    rules = {r: int(after[r] - rules_before[r]) for r in RULES if after[r] > rules_before[r]}
    return PolicyRun(mode=mode, outcomes=outcomes, switches=list(switcher.records),
                     rules=rules, wall_s=round(wall, 2), window_s=window_s,
                     models=[c.ref for c in claimants], slo_s=client.ttft_slo_s)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def rows(run: PolicyRun) -> list[dict[str, Any]]:
    """Per model: requests, served, goodput, TTFT p50/p90/p99 (over every arrival, a
    request never served counting as infinite), wakes (switches to it), wasted wakes
    (woken, no request served under that tenure), failed switches, its handoffs' median
    steps, the median decode rate of one of its streams (tokens after the first over the
    time after the first)."""
    served_fences = {o.fence for o in run.outcomes if math.isfinite(o.ttft_s)}
    out: list[dict[str, Any]] = []
    for k, ref in enumerate(run.models):
        mine = [o for o in run.outcomes if o.arrival.model == k]
        ttft = [o.ttft_s for o in mine]
        woken = [s for s in run.switches if s.target == ref and s.ok]
        errors: dict[str, int] = {}
        for o in mine:
            if o.error:
                errors[o.error] = errors.get(o.error, 0) + 1
        out.append({
            "model": f"m{k}", "claim": ref, "requests": len(mine),
            "served": sum(1 for t in ttft if math.isfinite(t)),
            "goodput": sum(1 for t in ttft if t <= run.slo_s),
            "p50": percentile(ttft, 0.5) if ttft else math.nan,
            "p90": percentile(ttft, 0.9) if ttft else math.nan,
            "p99": percentile(ttft, 0.99) if ttft else math.nan,
            "wakes": len(woken), "wasted": sum(1 for s in woken if s.fence not in served_fences),
            "failed_switches": sum(1 for s in run.switches if s.target == ref and not s.ok),
            "handoff_to_first_token_s": _median([s.timings["handoff_to_first_token"]
                                                 for s in woken
                                                 if "handoff_to_first_token" in s.timings]),
            "drain_s": _median([s.timings["drain"] for s in run.switches
                                if s.holder == ref and s.ok and "drain" in s.timings]),
            "sent_back": sum(o.attempts for o in mine),
            "decode_tok_s": _median([(o.arrival.generated - 1) / (o.done_s - o.ttft_s)
                                     for o in mine if math.isfinite(o.done_s)
                                     and o.done_s > o.ttft_s and o.arrival.generated > 1]),
            "errors": errors})
    return out
