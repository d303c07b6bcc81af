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

Each client keeps what it read (:class:`~e2e.gpu.policy_slo.StreamTrace`: every chunk's
time, the text, the engine's token count), so a run reports what users feel: the first
token, the longest gap between tokens, the SLO (both within their bounds), which streams
were frozen by a sleep of their engine, and their text against a never-slept reference.
:func:`replay_awake` is the bound beside the policies: every engine awake at once, no
worker and no switch, each request sent straight to its engine; :func:`references` asks
each engine in turn, woken alone, for the requests of a window, when that bound does not
fit on the GPU.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
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
from e2e.gpu.policy_slo import (
    Bounds,
    Reference,
    RefKey,
    StreamTrace,
    Verdict,
    correctness,
    gap_summary,
    reference_of,
    verdict,
    was_frozen,
)
from e2e.harness.ports import MemoryLeasePort
from rota.api import naming
from rota.api.gpu_lease import GpuLease

__all__ = ["Arrival", "ClientSettings", "Outcome", "PolicyRun", "RecordingSwitcher",
           "SwitchRecord", "check", "completion_body", "own_references", "read_stream",
           "references", "replay", "replay_awake", "rows"]


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
    trace: StreamTrace | None = None
    """What the client read of the stream that gave its first token (times from the
    window's start)."""
    frozen: bool = False
    """Its engine was put to sleep while the stream was open (see :func:`check`)."""
    verdict: Verdict = "unchecked"
    """Its text against the never-slept reference (see :func:`check`)."""

    @property
    def longest_gap_s(self) -> float:
        return self.trace.longest_gap_s if self.trace is not None else 0.0

    def key(self, client: ClientSettings) -> RefKey:
        """The request as its engine got it (prompt and length capped)."""
        return (self.arrival.model, min(self.arrival.context, client.max_context),
                max(1, min(self.arrival.generated, client.max_generated)))


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
    preempt: bool = False
    """The holder was put to sleep with its requests kept, not drained."""
    kept: int = 0
    """Requests the holder kept across its sleep (the switch's own count)."""

    @property
    def slept_at(self) -> float:
        """When the holder was put to sleep: the switch's start plus its drain."""
        return self.at - self.timings.get("total", 0.0) + self.timings.get("drain", 0.0)


class RecordingSwitcher(Switcher):
    """The controller's Switcher, unchanged, recording each switch it makes."""

    def __init__(self, *, records: list[SwitchRecord], clock: Callable[[], float],
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.records = records
        self.clock = clock
        self.origin = clock()

    async def switch(self, lease: GpuLease, *, holder: Claimant | None, target: Claimant,
                     claimants: Sequence[Claimant], **options: Any) -> SwitchResult:
        """The switch, recorded; ``options`` (``preempt``) go to the Switcher as given."""
        result = await super().switch(lease, holder=holder, target=target,
                                      claimants=claimants, **options)
        self.records.append(SwitchRecord(
            at=self.clock() - self.origin, holder=holder.ref if holder else None,
            target=target.ref, ok=result.ok, fence=result.lease.fence, reason=result.reason,
            timings=dict(result.timings), preempt=bool(options.get("preempt")),
            kept=int(getattr(result, "kept", 0) or 0)))
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
    bounds: Bounds = field(default_factory=Bounds)
    """The SLO: first token and longest gap (``ttft_slo_s`` is its first-token part)."""


@dataclass
class PolicyRun:
    mode: PolicyMode | None
    """The lease controller's ``--policy-mode`` (None: every engine awake, no worker)."""
    outcomes: list[Outcome]
    switches: list[SwitchRecord]
    rules: dict[str, int]
    wall_s: float
    window_s: float
    models: list[str]
    slo_s: float
    name: str = ""
    """The policy as the comparison names it (``drain`` may run as ``rota`` mode where
    the controller has no ``drain`` mode)."""
    bounds: Bounds = field(default_factory=Bounds)
    extra: dict[str, Any] = field(default_factory=dict)


def prompt_of(tokens: int) -> str:
    """A prompt of about ``tokens`` tokens: short common words, one token each in a
    byte-level BPE vocabulary (the test models' 4096-token one included)."""
    return "".join((" the", " and", " of", " to")[i % 4] for i in range(max(1, tokens)))


def completion_body(model: str, arrival: Arrival, client: ClientSettings) -> dict[str, Any]:
    """The completion as the trace asks for it: greedy and of forced length, so a stream
    can be compared with the same request to a never-slept engine."""
    return {"model": model, "prompt": prompt_of(min(arrival.context,
                                                             client.max_context)),
            "max_tokens": max(1, min(arrival.generated, client.max_generated)),
            "ignore_eos": True, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True}}


async def read_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                      first: asyncio.Event, trace: StreamTrace, clock: Callable[[], float]
                      ) -> None:
    """Read the stream into ``trace``; ``first`` is set at its first chunk."""
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"completion answered {resp.status}: "
                               f"{(await resp.text())[:200]}")
        async for line in resp.content:
            text = line.strip()
            if not text.startswith(b"data:"):
                continue
            trace.feed(clock(), text[5:].strip().decode("utf-8", errors="replace"))
            if trace.chunk_at and not first.is_set():
                first.set()
    trace.ended = clock()


def _moved_on(port: MemoryLeasePort, claimant: Claimant) -> bool:
    """The GPU's Lease has settled without naming the engine awake (another holder, or
    none, and not beside it in an awake set): an engine put to sleep holds the requests it
    had not begun (the gateway's step 3 sends them back)."""
    lease = port.current
    return not lease.names_awake(claimant.claim_uid) and lease.state in (
        naming.STATE_AWAKE, naming.STATE_IDLE)


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
    model, forward once the Lease names it awake (its holder, or a member of its awake set;
    with no lag: this gateway's view of the Lease is the Lease itself), and send it back to
    the activation when the Lease settles without it before its first token."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + arrival.at - loop.time()))
    began = loop.time()
    body = completion_body(claimant.model, arrival, client)
    first = asyncio.Event()
    stream: asyncio.Task[None] | None = None
    trace: StreamTrace | None = None
    try:
        async with asyncio.timeout(client.client_timeout_s):
            while not first.is_set():
                answer = await worker.activate(claimant)
                if not answer.ok:
                    out.error = answer.reason or "refused"
                    return
                lease = port.current
                if not lease.names_awake(claimant.claim_uid):
                    await asyncio.sleep(0.005)
                    continue
                out.fence = lease.fence
                trace = StreamTrace(started=loop.time() - t0)
                stream = asyncio.create_task(read_stream(session, url, body, first, trace,
                                                     lambda: loop.time() - t0))
                if not await _first_token(stream, first, port, claimant):
                    out.attempts += 1
            out.ttft_s = loop.time() - began
    except TimeoutError:
        out.error = out.error or "client_timeout"
    except (aiohttp.ClientError, RuntimeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    await _finish(stream, first, trace, out, client, began)


async def _finish(stream: asyncio.Task[None] | None, first: asyncio.Event,
                  trace: StreamTrace | None, out: Outcome, client: ClientSettings,
                  began: float) -> None:
    """Read a started stream to its end (within the decode bound), or cancel one that
    gave no first token."""
    if stream is None:
        return
    if not first.is_set():
        stream.cancel()
        await asyncio.gather(stream, return_exceptions=True)
        return
    out.trace = trace
    try:
        await asyncio.wait_for(stream, client.decode_bound_s)
        out.done_s = asyncio.get_running_loop().time() - began
    except (TimeoutError, aiohttp.ClientError, RuntimeError, OSError) as exc:
        out.error = f"after its first token: {type(exc).__name__}"
    if trace is not None:
        if out.error and not trace.error:
            trace.error = out.error
        elif trace.error and not out.error:
            out.error = trace.error


async def _direct_client(arrival: Arrival, out: Outcome, *, claimant: Claimant,
                         session: aiohttp.ClientSession, client: ClientSettings,
                         t0: float) -> None:
    """One request sent straight to its engine, which is awake (no activation, no Lease)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + arrival.at - loop.time()))
    began = loop.time()
    first = asyncio.Event()
    trace = StreamTrace(started=began - t0)
    stream = asyncio.create_task(read_stream(
        session, f"{claimant.endpoint}/v1/completions",
        completion_body(claimant.model, arrival, client), first, trace,
        lambda: loop.time() - t0))
    waiter = asyncio.create_task(first.wait())
    try:
        async with asyncio.timeout(client.client_timeout_s):
            await asyncio.wait({stream, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not first.is_set():
                await stream  # raises what ended it
        if first.is_set():
            out.ttft_s = loop.time() - began
    except TimeoutError:
        out.error = "client_timeout"
    except (aiohttp.ClientError, RuntimeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"[:200]
    finally:
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
    await _finish(stream, first, trace, out, client, began)


def _rules_now() -> dict[str, float]:
    return {r: metrics.REGISTRY.get_sample_value("rota_controller_policy_decisions_total",
                                                 {"rule": r}) or 0.0 for r in RULES}


async def replay(*, mode: PolicyMode, arrivals: Sequence[Arrival], claimants: Sequence[Claimant],
                 gpu: str, port: MemoryLeasePort, switcher: RecordingSwitcher,
                 engine: Callable[[Claimant], EngineAdapter], session: aiohttp.ClientSession,
                 client: ClientSettings, window_s: float, awake_set: bool = False
                 ) -> PolicyRun:
    """Replay ``arrivals`` (model index into ``claimants``) through a fresh GPU worker whose
    node-wide policy mode is ``mode`` and whose objectives are the ones measured (the
    client's bounds); every engine asleep and ``port`` idle at the start. ``awake_set``:
    the worker runs with ``--awake-set`` (engines awake together where they fit)."""
    settings = LeaseSettings(node_name="policy-run", policy_mode=mode,
                             first_token_objective_s=client.bounds.first_token_s,
                             longest_freeze_s=client.bounds.longest_freeze_s)
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
                      home_idle_s=settings.home_idle_s, awake_set=awake_set))
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
                     models=[c.ref for c in claimants], slo_s=client.ttft_slo_s,
                     name=mode.value, bounds=client.bounds)


async def replay_awake(*, arrivals: Sequence[Arrival], claimants: Sequence[Claimant],
                       session: aiohttp.ClientSession, client: ClientSettings,
                       window_s: float) -> PolicyRun:
    """Replay ``arrivals`` with every engine already awake: no worker, no Lease, no
    switch; each request goes straight to its engine. The bound the policies are read
    against (and, as no stream is ever frozen by a sleep, the never-slept references)."""
    loop = asyncio.get_running_loop()
    outcomes = [Outcome(a) for a in arrivals]
    t0 = loop.time() + 0.5
    await asyncio.gather(*(_direct_client(a, out, claimant=claimants[a.model],
                                          session=session, client=client, t0=t0)
                           for a, out in zip(arrivals, outcomes, strict=True)))
    return PolicyRun(mode=None, outcomes=outcomes, switches=[], rules={},
                     wall_s=round(loop.time() - t0, 2), window_s=window_s,
                     models=[c.ref for c in claimants], slo_s=client.ttft_slo_s,
                     name="all-awake", bounds=client.bounds)


async def references(*, arrivals: Sequence[Arrival], claimants: Sequence[Claimant],
                     switcher: Switcher, port: MemoryLeasePort,
                     session: aiohttp.ClientSession, client: ClientSettings,
                     concurrency: int) -> tuple[dict[RefKey, Reference], dict[str, Any]]:
    """The never-slept answers to the requests of ``arrivals``: each model's engine woken
    alone (through ``switcher``, which sleeps the one before), sent each distinct request
    of its model, ``concurrency`` at a time, with no switch while they run; the last one
    is put back to sleep. Also what it cost (seconds, switches that failed)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    found: dict[RefKey, Reference] = {}
    failed: list[str] = []
    gate = asyncio.Semaphore(max(1, concurrency))
    holder: Claimant | None = None
    for k, claimant in enumerate(claimants):
        wanted = sorted({Outcome(a).key(client) for a in arrivals if a.model == k})
        if not wanted:
            continue
        result = await switcher.switch(port.current, holder=holder, target=claimant,
                                       claimants=claimants)
        if not result.ok:
            failed.append(f"{claimant.ref}: {result.reason}")
            continue
        holder = claimant

        async def one(key: RefKey, c: Claimant = claimant) -> None:
            async with gate:
                trace = StreamTrace(started=loop.time())
                arrival = Arrival(0.0, key[0], key[1], key[2])
                try:
                    await asyncio.wait_for(
                        read_stream(session, f"{c.endpoint}/v1/completions",
                                    completion_body(c.model, arrival, client),
                                    asyncio.Event(), trace, loop.time),
                        client.client_timeout_s + client.decode_bound_s)
                except (TimeoutError, aiohttp.ClientError, RuntimeError, OSError):
                    return
                ref = reference_of(trace)
                if ref is not None:
                    found[key] = ref

        await asyncio.gather(*(one(key) for key in wanted))
    lease = port.current
    if holder is not None and lease.holder == holder.ref and lease.state == naming.STATE_AWAKE:
        await switcher.sleep_holder(lease, holder, reason="the references are taken")
    return found, {"seconds": round(loop.time() - began, 2), "references": len(found),
                   "failed_switches": failed}


def check(run: PolicyRun, refs: Mapping[RefKey, Reference], client: ClientSettings) -> None:
    """Mark each served request of ``run`` frozen or not (its engine slept while its
    stream was open) and give it its verdict against ``refs``."""
    sleeps: dict[str, list[float]] = {}
    for s in run.switches:
        if s.ok and s.holder is not None:
            sleeps.setdefault(s.holder, []).append(s.slept_at)
    for o in run.outcomes:
        o.frozen = was_frozen(o.trace, sleeps.get(run.models[o.arrival.model], []),
                              run.bounds)
        o.verdict = verdict(o.trace, refs.get(o.key(client)))


def own_references(run: PolicyRun, client: ClientSettings) -> dict[RefKey, Reference]:
    """The answers of a run none of whose streams was put to sleep (the all-awake one)."""
    found: dict[RefKey, Reference] = {}
    for o in run.outcomes:
        ref = reference_of(o.trace) if not o.frozen else None
        if ref is not None:
            found.setdefault(o.key(client), ref)
    return found


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
            "errors": errors} | user_columns(run, mine))
    return out


def user_columns(run: PolicyRun, mine: Sequence[Outcome]) -> dict[str, Any]:
    """What the requests' users felt: SLO goodput (first token and longest gap within
    the bounds), the longest gaps of the served streams, the frozen ones and their
    verdicts against the references (set by :func:`check`)."""
    served = [o for o in mine if math.isfinite(o.ttft_s)]
    counts = correctness((o.frozen, o.verdict) for o in served)
    return {"slo_goodput": sum(1 for o in mine
                               if run.bounds.met(o.ttft_s, o.longest_gap_s) and not o.error),
            "longest_gap_s": gap_summary([o.longest_gap_s for o in served]),
            "frozen": sum(1 for o in served if o.frozen),
            "identical": counts["frozen"]["identical"],
            "altered": counts["frozen"]["altered"], "lost": counts["frozen"]["lost"],
            "unchecked": counts["frozen"]["unchecked"],
            "not_frozen": counts["not_frozen"]}
