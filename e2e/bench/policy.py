"""Switch policy on a real trace: models taking turns on one simulated GPU, side by side.

``python -m e2e.bench.policy`` replays a trace (by default the Azure LLM inference trace
2023 in ``shared/data/azure-llm-inference-2023``, or any CSV of ``timestamp, model,
context_tokens, generated_tokens`` given with ``--trace``) against N models sharing one
GPU, and compares, on the same arrivals:

- ``on-demand``: first-come switching, llama-swap's behaviour (one global queue in arrival
  order; a request for a sleeping model drains the holder, sleeps it and wakes its model);
- ``rota``: :func:`controller.lease.policy.decide` with the lease controller's default
  settings, every engine a vLLM level-1 claim that keeps its requests: a switch may
  preempt the holder (its running requests freeze, kept by its sleeping engine, and are
  recomputed after its next wake) instead of draining it;
- ``drain``: the same rules in ``--policy-mode drain``: every switch drains the holder
  (rota's policy before turns at token granularity);
- ``rota-prio-home``: ``rota`` with model 0 at a higher priority and as the GPU's home;
- ``static``: a fixed time split (each model a fixed slot of ``--static-period-s``, in turn);
- ``all-awake``: every engine awake at once, each on its own share of nothing (no
  switching, no contention between them): the bound where the engines fit together.

The engines are simulated in fixed steps of ``--step-s`` (default 20 ms), calibrated from
the H200 measurements of vLLM 0.26 (README, "With real vLLM on a GPU"): a level-1 wake
takes weight bytes / 55.3 GB/s x 1.23 (measured 1.19-1.27 x the copy floor), a later
level-1 sleep weight bytes / 55.3 GB/s x 1.11 (0.533 s for 26.5 GB), the first token after
a wake 0.086 s (recovery 0.686 s minus the 0.600 s wake call); decoding one step takes
24.5 ms per 26.5 GB of weights (measured 326 tok/s over 8 sequences for the 26.5 GB model,
eager), at least 10 ms, for every running sequence at once up to ``--max-seqs``; prefill
runs at ``--prefill-tflops`` (an assumption, not measured: 2 FLOP per parameter per
token, bf16 weights). A switch drains the holder (its requests in flight finish), as rota's
switch and llama-swap's do, unless the policy preempts it: then its running and queued
requests stay with its sleeping engine, frozen, and at its next wake each running one is
prefilled again (its prompt and the tokens it had generated) before its next token, as
vLLM recomputes requests kept across a sleep. A client leaves after
``--client-timeout-s`` without a first token (counted as not served, TTFT infinite).

Reported per model: requests, served, goodput (first token within ``--ttft-slo-s``), SLO
goodput (that, and no gap between two tokens over ``--longest-freeze-s``), TTFT
p50/p90/p99 (over all arrivals, a request never served counting as infinite), the
requests frozen by a preemption, mean wait for a switch, wakes per hour, wasted wakes
(woken, no request served), the GPU share it was awake. One PNG per policy
(``--plot-dir``): the GPU's owner over time and the queues.

Data: Azure LLM inference trace 2023, CC-BY 4.0 (attribution below, printed with every
result).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import itertools
import math
import os
import sys
import textwrap
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from controller.lease.policy import (
    Action,
    ClaimQueue,
    GpuView,
    KeptWork,
    ModelPolicy,
    PolicyInput,
    PolicyMode,
    SwitchCost,
    decide,
)
from controller.lease.settings import LeaseSettings
from controller.lease.worker.accounting import COST_FIELDS, with_estimates
from e2e.bench.stats import percentile

ATTRIBUTION = (
    "Trace data: Azure LLM inference trace 2023 (AzurePublicDataset), CC-BY 4.0; Pratyush "
    "Patel, Esha Choukse, Chaojie Zhang, Aashaka Shah, Íñigo Goiri, Saeed Maleki, Ricardo "
    "Bianchini, \"Splitwise: Efficient generative LLM inference using phase splitting\", "
    "ISCA 2024.")

def _data_dir() -> Path:
    """Where the Azure trace lies: ``ROTA_TRACE_DIR``, else ``shared/data`` inside or
    beside the checkout."""
    if os.environ.get("ROTA_TRACE_DIR"):
        return Path(os.environ["ROTA_TRACE_DIR"])
    root = Path(__file__).resolve().parents[2]
    for base in (root / "shared", root.parent / "shared"):
        if (base / "data/azure-llm-inference-2023").exists():
            return base / "data/azure-llm-inference-2023"
    return root / "shared/data/azure-llm-inference-2023"


DATA = _data_dir()

COPY_GBPS = 55.3
WAKE_RATIO = 1.23
SLEEP_RATIO = 1.11
PROBE_S = 0.086
STEP_PER_26GB_S = 0.0245
MIN_STEP_S = 0.010
POLICIES = ("on-demand", "drain", "rota", "rota-prio-home", "static", "all-awake")


@dataclass
class Request:
    arrival: float
    model: int
    context: int
    generated: int
    first_token: float = math.inf
    forwarded: float = math.inf
    left: bool = False
    prefill_left: float = 0.0
    decode_left: float = 0.0
    frozen_at: float = math.inf
    """When its engine last slept with it kept (inf: never)."""
    recomputing: bool = False
    """Kept across a sleep after its first token: its prefill now is the recompute."""
    gap_s: float = 0.0
    """The longest wait between two of its tokens (a freeze and its recompute)."""

    def tokens_done(self) -> int:
        """Prompt and generated tokens so far: what a recompute prefills again."""
        started = math.isfinite(self.first_token)
        return self.context + (max(0, round(self.generated - 1 - self.decode_left)) + 1
                               if started else 0)


@dataclass(frozen=True)
class EngineModel:
    name: str
    weight_bytes: float
    prefill_tok_s: float
    decode_step_s: float

    @property
    def wake_s(self) -> float:
        return self.weight_bytes / (COPY_GBPS * 1e9) * WAKE_RATIO

    @property
    def sleep_s(self) -> float:
        return self.weight_bytes / (COPY_GBPS * 1e9) * SLEEP_RATIO


def engine_models(weights_gb: Sequence[float], n: int, tflops: float) -> list[EngineModel]:
    out = []
    for i in range(n):
        size = weights_gb[i % len(weights_gb)] * 1e9
        params = size / 2
        out.append(EngineModel(f"m{i}", size, tflops * 1e12 / (2 * params),
                               max(MIN_STEP_S, STEP_PER_26GB_S * size / 26.5e9)))
    return out


# -- traces --------------------------------------------------------------------------------

def _stamp(text: str) -> float:
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        head, _, frac = text.partition(".")
        return datetime.fromisoformat(head).timestamp() + (float("0." + frac) if frac else 0.0)


def _azure(name: str) -> list[tuple[float, int, int]]:
    with (DATA / f"AzureLLMInferenceTrace_{name}.csv").open() as f:
        rows = [(_stamp(r["TIMESTAMP"]), int(r["ContextTokens"]), int(r["GeneratedTokens"]))
                for r in csv.DictReader(f)]
    t0 = rows[0][0]
    return [(t - t0, c, g) for t, c, g in rows]


def load_arrivals(*, trace: Path | None, mapping: str, models: int, speed: float,
                  start_s: float, duration_s: float, limit: int | None) -> list[Request]:
    """Arrivals mapped to ``models`` streams (see ``--mapping``), compressed by ``speed``."""
    streams: list[tuple[float, int, int, int]] = []
    if trace is not None:
        with trace.open() as f:
            reader = csv.reader(f)
            names: dict[str, int] = {}
            rows = [r for r in reader if r and not r[0].lower().startswith("timestamp")]
            t0 = min(_stamp(r[0]) for r in rows)
            for r in rows:
                k = names.setdefault(r[1], len(names)) % models
                streams.append((_stamp(r[0]) - t0, k, int(r[2]), int(r[3])))
    else:
        code, conv = _azure("code"), _azure("conv")
        if mapping == "services":
            if models != 2:
                raise SystemExit("--mapping services gives exactly 2 models")
            streams = [(t, 0, c, g) for t, c, g in code] + [(t, 1, c, g) for t, c, g in conv]
        elif mapping == "modulo":
            kc = max(1, models // 3)
            kv = models - kc
            streams = [(t, i % kc, c, g) for i, (t, c, g) in enumerate(code)]
            streams += [(t, kc + i % kv, c, g) for i, (t, c, g) in enumerate(conv)]
        elif mapping == "shift":
            span = code[-1][0]
            streams = [((t + k * span / models) % span, k, c, g)
                       for k in range(models) for t, c, g in code]
        else:
            raise SystemExit(f"unknown mapping {mapping}")
    streams.sort()
    out = [Request(t / speed - start_s, k, c, max(1, g)) for t, k, c, g in streams
           if start_s <= t / speed < start_s + duration_s]
    return out[:limit] if limit else out


# -- the simulated GPU --------------------------------------------------------------------

@dataclass
class Stats:
    wakes: int = 0
    wasted: int = 0
    awake_s: float = 0.0
    switch_wait_s: float = 0.0


@dataclass
class Gpu:
    models: list[EngineModel]
    max_seqs: int
    state: str = "idle"  # idle, awake, drain, sleep, wake
    holder: int | None = None
    target: int | None = None
    until: float = 0.0
    awake_since: float = 0.0
    idle_since: float = 0.0
    last_request: float = -math.inf
    served_in_tenure: int = 0
    engine_wait: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    drain_began: float = 0.0
    measured_drain: dict[int, float] = field(default_factory=dict)
    woken_in_s: float = 0.0
    """What the holder's wake took to its first token, as the lease controller measures
    it: the wake and the probe, which waits for the recompute of its kept requests."""
    woken: set[int] = field(default_factory=set)
    kept: dict[int, tuple[float, list[Request]]] = field(default_factory=dict)
    """Per sleeping model, when it was preempted and the requests it keeps."""
    timeline: list[tuple[float, int]] = field(default_factory=list)
    """(time, owner): -1 idle, -2 switching, else the awake model."""

    def in_flight(self) -> int:
        return len(self.engine_wait) + len(self.running)


class Sim:
    def __init__(self, arrivals: list[Request], models: list[EngineModel], *, step_s: float,
                 max_seqs: int, client_timeout_s: float, chooser: Callable[[Sim], None],
                 end_s: float) -> None:
        self.arrivals = arrivals
        self.models = models
        self.step = step_s
        self.gpu = Gpu(models, max_seqs)
        self.queues: list[deque[Request]] = [deque() for _ in models]
        self.fifo: deque[Request] = deque()
        self.stats = [Stats() for _ in models]
        self.client_timeout_s = client_timeout_s
        self.chooser = chooser
        self.end = end_s
        self.now = 0.0
        self.usage = [0.0] * len(models)
        self.samples: list[tuple[float, list[int]]] = []
        self.rules: dict[str, int] = {}

    # actions the policies take
    def begin_switch(self, target: int, *, preempt: bool = False) -> None:
        g = self.gpu
        if g.state == "awake" and g.holder is not None and preempt:
            self._freeze(g.holder)
            g.state, g.target = "sleep", target
            g.until = self.now + self.models[g.holder].sleep_s
        elif g.state == "awake" and g.holder is not None:
            g.state, g.target, g.drain_began = "drain", target, self.now
        elif g.state == "idle":
            self._begin_wake(target)
        g.timeline.append((self.now, -2))

    def start_awake(self, model: int) -> None:
        """The engine of ``model`` is awake from the start (the all-awake bound)."""
        g = self.gpu
        g.state, g.holder, g.awake_since = "awake", model, 0.0
        g.woken.add(model)
        g.timeline.append((0.0, model))

    def _freeze(self, model: int) -> None:
        """The holder sleeps with its requests kept: none finishes, none is lost."""
        g = self.gpu
        kept = [*g.running, *g.engine_wait]
        for r in kept:
            r.frozen_at = self.now
        g.kept[model] = (self.now, kept)
        g.running, g.engine_wait = [], deque()

    def _resume(self, model: int) -> float:
        """A woken engine takes back what it kept: its running requests are prefilled
        again (prompt and generated tokens) before their next token. Returns how many
        tokens it recomputes."""
        g = self.gpu
        _, kept = g.kept.pop(model, (0.0, []))
        tokens = 0.0
        for r in kept:
            if r.left:
                continue
            if math.isfinite(r.first_token):
                r.prefill_left, r.recomputing = float(r.tokens_done()), True
                tokens += r.prefill_left
            g.engine_wait.append(r)
        if kept:
            g.served_in_tenure += 1
        return tokens

    def begin_sleep(self) -> None:
        g = self.gpu
        if g.state == "awake":
            g.state, g.target, g.drain_began = "drain", None, self.now
            g.timeline.append((self.now, -2))

    def _begin_wake(self, target: int) -> None:
        g = self.gpu
        m = self.models[target]
        g.state, g.target, g.until = "wake", target, self.now + m.wake_s + PROBE_S

    def run(self) -> None:
        g = self.gpu
        i = 0
        next_sample = 0.0
        while self.now <= self.end + 600:  # past the last arrival: until its work is done
            while i < len(self.arrivals) and self.arrivals[i].arrival <= self.now:
                r = self.arrivals[i]
                self.queues[r.model].append(r)
                self.fifo.append(r)
                i += 1
            self._timeouts()
            self._advance_gpu()
            if g.state == "awake" and g.holder is not None:
                self._forward(g.holder)
            if g.state in ("awake", "idle"):
                self.chooser(self)
            self._engine_step()
            for k in range(len(self.models)):
                self.usage[k] *= math.exp(-self.step / 300.0)
            if g.state in ("awake", "drain") and g.holder is not None:
                self.stats[g.holder].awake_s += self.step
                self.usage[g.holder] += self.step
            if self.now >= next_sample:
                self.samples.append((self.now, [len(q) for q in self.queues]))
                next_sample += 5.0
            self.now += self.step
            if i >= len(self.arrivals) and not any(self.queues) and not g.in_flight() \
                    and not g.kept and self.now >= self.end:
                break

    def _timeouts(self) -> None:
        limit = self.now - self.client_timeout_s
        for q in self.queues:
            while q and (q[0].arrival < limit or q[0].left):
                r = q.popleft()
                r.left = True
        g = self.gpu
        if g.engine_wait and g.engine_wait[0].arrival < limit:
            keep = deque(r for r in g.engine_wait if r.arrival >= limit)
            for r in g.engine_wait:
                if r.arrival < limit:
                    r.left = True
            g.engine_wait = keep
        while self.fifo and (self.fifo[0].left or self.fifo[0].forwarded < math.inf):
            self.fifo.popleft()

    def _forward(self, model: int) -> None:
        g = self.gpu
        q = self.queues[model]
        while q:
            r = q.popleft()
            r.forwarded = self.now
            self.stats[model].switch_wait_s += self.now - r.arrival
            g.engine_wait.append(r)
            g.last_request = self.now
            g.served_in_tenure += 1

    def _advance_gpu(self) -> None:
        g = self.gpu
        if g.state == "drain" and g.in_flight() == 0:
            assert g.holder is not None
            g.measured_drain[g.holder] = self.now - g.drain_began
            g.state, g.until = "sleep", self.now + self.models[g.holder].sleep_s
        if g.state == "sleep" and self.now >= g.until:
            assert g.holder is not None
            if g.served_in_tenure == 0:
                self.stats[g.holder].wasted += 1
            g.holder = None
            g.idle_since = self.now
            if g.target is None:
                g.state = "idle"
                g.timeline.append((self.now, -1))
            else:
                if self._cancel(g.target):
                    g.state, g.target = "idle", None
                    g.timeline.append((self.now, -1))
                else:
                    self._begin_wake(g.target)
        if g.state == "wake" and self.now >= g.until:
            assert g.target is not None
            g.state, g.holder, g.target = "awake", g.target, None
            g.awake_since = g.last_request = self.now
            g.served_in_tenure = 0
            self.stats[g.holder].wakes += 1
            g.woken.add(g.holder)
            g.timeline.append((self.now, g.holder))
            m = self.models[g.holder]
            g.woken_in_s = m.wake_s + PROBE_S + self._resume(g.holder) / m.prefill_tok_s

    def _cancel(self, target: int) -> bool:
        return False

    def _engine_step(self) -> None:
        g = self.gpu
        if g.state not in ("awake", "drain") or g.holder is None:
            return
        m = self.models[g.holder]
        while g.engine_wait and len(g.running) < g.max_seqs:
            r = g.engine_wait.popleft()
            if not r.recomputing:
                r.prefill_left = float(r.context)
                r.decode_left = float(r.generated - 1)
            g.running.append(r)
        budget = m.prefill_tok_s * self.step
        for r in g.running:
            if r.prefill_left > 0 and budget > 0:
                used = min(budget, r.prefill_left)
                r.prefill_left -= used
                budget -= used
                if r.prefill_left <= 0:
                    done = self.now + self.step * (1 - budget / (m.prefill_tok_s * self.step))
                    if r.recomputing:  # its next token after the freeze
                        r.gap_s = max(r.gap_s, done - r.frozen_at)
                        r.recomputing = False
                    else:
                        r.first_token = done
        tokens = self.step / m.decode_step_s
        for r in g.running:
            if r.prefill_left <= 0 and r.first_token <= self.now:
                r.decode_left -= tokens
        g.running = [r for r in g.running if r.prefill_left > 0 or r.decode_left > 0
                     or r.first_token > self.now]


# -- the policies -------------------------------------------------------------------------

def on_demand(sim: Sim) -> None:
    """llama-swap: the head of the one arrival-ordered queue decides."""
    g = sim.gpu
    if not sim.fifo:
        return
    head = sim.fifo[0]
    if g.state == "awake" and head.model == g.holder:
        return  # forwarded by the loop already
    if g.state in ("awake", "idle"):
        sim.begin_switch(head.model)


def static_split(period_s: float) -> Callable[[Sim], None]:
    def choose(sim: Sim) -> None:
        g = sim.gpu
        n = len(sim.models)
        slot = int(sim.now // period_s) % n
        if g.holder != slot and g.state in ("awake", "idle"):
            sim.begin_switch(slot)
    return choose


def defaults() -> ModelPolicy:
    """The lease controller's default policy, from its settings' defaults."""
    return LeaseSettings(node_name="bench").model_policy()


class RotaPolicy:
    def __init__(self, policies: dict[str, ModelPolicy], home: str | None,
                 home_idle_s: float, default: ModelPolicy | None = None) -> None:
        self.policies = policies
        self.home = home
        self.home_idle_s = home_idle_s
        self.default = default or defaults()

    def state(self, sim: Sim, *, pending: int | None = None) -> PolicyInput:
        g = sim.gpu
        names = [m.name for m in sim.models]
        queues = tuple(ClaimQueue(names[k], len(q), q[0].arrival)
                       for k, q in enumerate(sim.queues) if q)
        # what the lease controller knows: the costs of the engines woken so far, as
        # measured (the recompute at the engine's prefill rate, which the probe after a
        # wake with requests kept measures), the others' estimated from them
        costs = with_estimates(
            {m.name: SwitchCost(m.sleep_s, m.wake_s, PROBE_S, m.prefill_tok_s)
             for k, m in enumerate(sim.models) if k in g.woken},
            {names[k]: set(COST_FIELDS) for k in g.woken},
            {m.name: round(m.weight_bytes) for m in sim.models})
        holder = names[g.holder] if g.holder is not None and pending is None else None
        view = GpuView(now=sim.now, holder=holder, awake_since=g.awake_since,
                       last_request=g.last_request, in_flight=g.in_flight(),
                       drain_estimate_s=g.measured_drain.get(g.holder, 0.0)
                       if g.holder is not None else 0.0,
                       pending=names[pending] if pending is not None else None,
                       idle_since=g.idle_since, woken_in_s=g.woken_in_s)
        kept = {names[k]: KeptWork(len(reqs), since, sum(r.tokens_done() for r in reqs))
                for k, (since, reqs) in g.kept.items() if reqs}
        return PolicyInput(gpu=view, queues=queues, policies=self.policies, costs=costs,
                           default_policy=self.default, home=self.home,
                           home_idle_s=self.home_idle_s,
                           usage_s={names[k]: u for k, u in enumerate(sim.usage) if u > 0},
                           kept=kept)

    def __call__(self, sim: Sim) -> None:
        d = decide(self.state(sim))
        if d.action is Action.STAY:
            return
        sim.rules[d.rule] = sim.rules.get(d.rule, 0) + 1
        if d.action is Action.SWITCH and d.target is not None:
            sim.begin_switch(int(d.target[1:]), preempt=d.preempt)
        elif d.action is Action.SLEEP:
            sim.begin_sleep()

    def cancel(self, sim: Sim, target: int) -> bool:
        d = decide(self.state(sim, pending=target))
        if d.action is Action.CANCEL:
            sim.rules[d.rule] = sim.rules.get(d.rule, 0) + 1
            return True
        return False


# -- running and reporting ----------------------------------------------------------------

@dataclass
class Result:
    policy: str
    rows: list[dict[str, object]]
    total_goodput: int
    sim: Sim
    total_slo_goodput: int = 0
    """Requests with their first token within the objective and no gap over the bound."""


def rota_policy(policy: str, args: argparse.Namespace) -> RotaPolicy:
    """rota's rules as the lease controller runs them for vLLM level-1 claims (which keep
    their requests): preemptive in ``rota`` mode, draining in ``drain`` mode; the
    objectives it aims at are the ones measured (``--ttft-slo-s``, ``--longest-freeze-s``)."""
    d = dataclasses.replace(defaults(), keeps_requests=True,
                            mode=PolicyMode.DRAIN if policy == "drain" else PolicyMode.ROTA,
                            first_token_s=args.ttft_slo_s,
                            longest_freeze_s=getattr(args, "longest_freeze_s", 3.0))
    policies: dict[str, ModelPolicy] = {}
    home = None
    if policy == "rota-prio-home":
        policies["m0"] = dataclasses.replace(d, priority=10)
        home = "m0"
    return RotaPolicy(policies, home, LeaseSettings(node_name="bench").home_idle_s, d)


def _run_one(policy: str, fresh: list[Request], models: list[EngineModel],
             args: argparse.Namespace, end: float, awake: int | None = None) -> Sim:
    chooser: Callable[[Sim], None]
    rota: RotaPolicy | None = None
    if policy == "on-demand":
        chooser = on_demand
    elif policy == "static":
        chooser = static_split(args.static_period_s)
    elif policy == "all-awake":
        chooser = _stay
    else:
        rota = rota_policy(policy, args)
        chooser = rota
    sim = Sim(fresh, models, step_s=args.step_s, max_seqs=args.max_seqs,
              client_timeout_s=args.client_timeout_s, chooser=chooser, end_s=end)
    if awake is not None:
        sim.start_awake(awake)
    if rota is not None:
        sim._cancel = lambda target: rota.cancel(sim, target)  # type: ignore[method-assign]
    sim.run()
    return sim


def _stay(sim: Sim) -> None:
    """The all-awake engine's chooser: it never switches."""


def simulate(policy: str, arrivals: list[Request], models: list[EngineModel],
             args: argparse.Namespace) -> Result:
    fresh = [Request(r.arrival, r.model, r.context, r.generated) for r in arrivals]
    end = max((r.arrival for r in fresh), default=0.0)
    if policy == "all-awake":  # one GPU each, awake from the start: nothing shared
        sims = [_run_one(policy, [r for r in fresh if r.model == k], models, args, end,
                         awake=k) for k in range(len(models))]
    else:
        sims = [_run_one(policy, fresh, models, args, end)] * len(models)
    hours = max(end, 1.0) / 3600.0
    freeze = getattr(args, "longest_freeze_s", 3.0)
    rows: list[dict[str, object]] = []
    total = total_slo = 0
    for k, m in enumerate(models):
        mine = [r for r in fresh if r.model == k]
        ttft = [r.first_token - r.arrival for r in mine]
        good = sum(1 for t in ttft if t <= args.ttft_slo_s)
        slo = sum(1 for r in mine if r.first_token - r.arrival <= args.ttft_slo_s
                  and r.gap_s <= freeze)
        total += good
        total_slo += slo
        st = sims[k].stats[k]
        rows.append({
            "model": f"{m.name} ({m.weight_bytes / 1e9:g} GB)", "requests": len(mine),
            "served": sum(1 for t in ttft if math.isfinite(t)), "goodput": good,
            "slo_goodput": slo, "frozen": sum(1 for r in mine if math.isfinite(r.frozen_at)),
            "longest_gap": max((r.gap_s for r in mine), default=0.0),
            "p50": percentile(ttft, 0.5) if ttft else math.nan,
            "p90": percentile(ttft, 0.9) if ttft else math.nan,
            "p99": percentile(ttft, 0.99) if ttft else math.nan,
            "switch_wait": st.switch_wait_s / max(1, len(mine)),
            "wakes_h": st.wakes / hours, "wasted": st.wasted,
            "awake": st.awake_s / max(end, 1e-9)})
    return Result(policy, rows, total, sims[0], total_slo)


def _f(v: object) -> str:
    if isinstance(v, float):
        return "∞" if math.isinf(v) else f"{v:.2f}"
    return str(v)


def table(results: Sequence[Result], slo: float, freeze: float = 3.0) -> str:
    head = ("| policy | model | requests | served | goodput (TTFT ≤ "
            f"{slo:g} s) | TTFT p50 s | p90 s | p99 s | switch wait s (mean) | wakes/h "
            f"| wasted wakes | GPU awake share | SLO met (and gaps ≤ {freeze:g} s) | frozen "
            "| longest gap s |")
    lines = [head, "|" + "---|" * 15]
    for res in results:
        for row in res.rows:
            lines.append("| " + " | ".join([res.policy, *(
                _f(row[k]) for k in ("model", "requests", "served", "goodput", "p50", "p90",
                                     "p99", "switch_wait", "wakes_h", "wasted"))],
                ) + f" | {row['awake']:.0%} | {row['slo_goodput']} | {row['frozen']} | "
                f"{_f(row['longest_gap'])} |")
        lines.append(f"| **{res.policy}** | **all** | | | **{res.total_goodput}** | | | | | | "
                     f"| | **{res.total_slo_goodput}** | | |")
    return "\n".join(lines)


def plot(res: Result, path: Path, n: int) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 5), sharex=True)
    tl = [*res.sim.gpu.timeline, (res.sim.now, -1)]
    for (t0, owner), (t1, _) in itertools.pairwise(tl):
        top.barh(0, t1 - t0, left=t0, color="lightgrey" if owner == -1 else
                 "black" if owner == -2 else f"C{owner}", height=0.8)
    top.set_yticks([])
    top.set_title(f"{res.policy}: GPU owner (colour = model; black = switching, the "
                  "holder's drain included; grey = idle)")
    times = [t for t, _ in res.sim.samples]
    for k in range(n):
        bottom.plot(times, [q[k] for _, q in res.sim.samples], color=f"C{k}", label=f"m{k}",
                    linewidth=0.8)
    bottom.set_ylabel("queued for a switch")
    bottom.set_xlabel("simulated time (s; the trace's time divided by --speed)")
    bottom.legend(loc="upper right")
    fig.text(0.01, 0.005, textwrap.fill(ATTRIBUTION, 180), fontsize=5)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m e2e.bench.policy", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=None, help="CSV of timestamp, model, "
                   "context tokens, generated tokens (default: the Azure trace)")
    p.add_argument("--mapping", choices=("services", "modulo", "shift"), default="modulo",
                   help="Azure streams to models: services (code, conversation: 2 models); "
                   "modulo (code split by request index modulo max(1, N//3), conversation "
                   "modulo the rest); shift (the code service N times, each shifted by "
                   "1/N of the hour)")
    p.add_argument("--models", type=int, default=3)
    p.add_argument("--weights-gb", default="16,16,6.4,26.5,1",
                   help="weight bytes of each model in GB, in turn")
    p.add_argument("--speed", type=float, default=0.1, help="time compression (2: twice "
                   "as fast as recorded; the default 0.1 replays one tenth of the rate: a "
                   "whole Azure service's traffic is far more than one GPU serves)")
    p.add_argument("--start-s", type=float, default=0.0)
    p.add_argument("--duration-s", type=float, default=math.inf, help="simulated seconds "
                   "of the (compressed) trace to replay (default: all)")
    p.add_argument("--limit", type=int, default=None, help="at most this many arrivals")
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--longest-freeze-s", type=float, default=3.0,
                   help="the SLO's bound on the gap between two tokens of a stream")
    p.add_argument("--client-timeout-s", type=float, default=60.0)
    p.add_argument("--max-seqs", type=int, default=32)
    p.add_argument("--prefill-tflops", type=float, default=400.0)
    p.add_argument("--step-s", type=float, default=0.02)
    p.add_argument("--static-period-s", type=float, default=10.0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--plot-dir", type=Path, default=None)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    models = engine_models([float(x) for x in args.weights_gb.split(",")], args.models,
                           args.prefill_tflops)
    arrivals = load_arrivals(trace=args.trace, mapping=args.mapping, models=args.models,
                             speed=args.speed, start_s=args.start_s,
                             duration_s=args.duration_s, limit=args.limit)
    results = [simulate(p, arrivals, models, args) for p in args.policies.split(",")]
    print(f"{len(arrivals)} arrivals, {args.models} models (mapping {args.mapping}, speed "
          f"{args.speed:g}), simulated H200-calibrated engines")
    print()
    print(table(results, args.ttft_slo_s, args.longest_freeze_s))
    print()
    base = next((r.total_goodput for r in results if r.policy == "on-demand"), 0)
    for res in results:
        ratio = f" ({res.total_goodput / base:.2f} x on-demand)" if base else ""
        rules = ", ".join(f"{k} {v}" for k, v in sorted(res.sim.rules.items()))
        print(f"- {res.policy}: goodput {res.total_goodput}{ratio}, SLO goodput "
              f"{res.total_slo_goodput}" + (f"; rules fired: {rules}" if rules else ""))
        if args.plot_dir is not None and res.policy != "all-awake":
            args.plot_dir.mkdir(parents=True, exist_ok=True)
            path = args.plot_dir / f"bench_policy_{res.policy}.png"
            if plot(res, path, args.models):
                print(f"  plot: {path}")
    print()
    print(ATTRIBUTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
