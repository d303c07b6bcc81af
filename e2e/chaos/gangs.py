"""The gang chaos campaign: tensor-parallel and one-GPU engines taking turns on an 8-GPU node
under faults, through the controller's own GPU workers, locks and gang switches.

    python -m e2e.chaos.gangs --switches 10000 --seed 1

Engines are real simulators on loopback (vLLM 0.26's behaviour); the GPU Leases live in
memory with the API server's compare-and-swap; the device is what NVML shows of the
simulators (one process per engine and GPU). The mix: one TP=4 engine, four TP=2 engines
(one of them across the two halves of the node), eight one-GPU engines. Clients ask for
random engines; faults come and go: a wake that fails, a sleep that lies (it answers but
keeps the memory), a stranger holding memory on a GPU, and the controller killed in the
middle of whatever it does and replaced by a new instance on the same Leases.

It counts what the promise is about: instants with two engines awake on one GPU (checked
at every memory change of every engine), activations without an answer within their bound
(a deadlock or a lost waiter), and at the end every GPU with one owner: its Lease names
the engine awake on it, or nobody when none is. The report gives the figures per GPU.

``--awake-set`` runs the controller with awake sets on a mix made for them
(:data:`SET_MIX`: three one-GPU engines on each of six GPUs, any two of which fit awake
together and never three, and a TP=2 engine whose GPUs stay one-awake). The promise checked
at every memory change is the set's (:class:`~e2e.harness.gang_node.AwakeSetWatch`): no
instant with a GPU's processes over its memory, none with more engines awake than their
budgets fit, none with two awake beside an engine that spans GPUs; at the end every GPU's
awake engines are exactly the ones its Lease names.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import aiohttp

from controller.lease.metrics import SwitchMetrics
from e2e.harness.gang_node import AwakeSetWatch, GangNode, gang_node, node_of, start_sim
from rota.api import naming
from rota.kit.engine_connections import engine_connector

__all__ = ["GangCampaign", "Report", "run"]

NODE_MIX: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("tp4", ("gpu-0", "gpu-1", "gpu-2", "gpu-3"), 80),
    ("tp2-a", ("gpu-0", "gpu-1"), 40),
    ("tp2-b", ("gpu-2", "gpu-3"), 40),
    ("tp2-c", ("gpu-4", "gpu-5"), 40),
    ("tp2-x", ("gpu-3", "gpu-4"), 40),
    ("tp2-d", ("gpu-6", "gpu-7"), 40),
    *((f"one-{i}", (f"gpu-{i}",), 20) for i in range(8)),
)
"""Name, GPUs and awake GiB (across its GPUs) of each engine; every GPU's residents plus
its largest awake shard fit a 141 GiB H200."""

SET_MIX: tuple[tuple[str, tuple[str, ...], int], ...] = (
    *((f"{kind}-{i}", (f"gpu-{i}",), gib) for i in range(6)
      for kind, gib in (("a", 60), ("b", 50), ("c", 40))),
    ("tp2", ("gpu-6", "gpu-7"), 80),
    *((f"one-{i}", (f"gpu-{i}",), 60) for i in (6, 7)),
)
"""The awake-set mix: on gpu-0 to gpu-5 three engines of 60, 50 and 40 GiB (any two fit a
141 GiB H200 awake together, all three never do); on gpu-6 and gpu-7 a TP=2 engine beside
a one-GPU engine each, where sets are off."""

ANSWER_BOUND_S = 60.0
"""An activation not answered within this is counted unanswered (a deadlock, a lost
waiter): far above any switch here, which takes milliseconds to a few seconds."""


@dataclass
class Report:
    switches: int = 0
    ok: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    unanswered: int = 0
    restarts: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    longest_answer_s: float = 0.0
    violations: list[str] = field(default_factory=list)
    per_gpu: dict[str, dict[str, object]] = field(default_factory=dict)
    unowned: list[str] = field(default_factory=list)
    lingering: int = 0
    """Workers of a killed instance still running 30 s after it was killed."""
    timed_out: bool = False
    stalls: int = 0
    """Times no switch ended for 30 s (the stacks go to stderr)."""
    seconds: float = 0.0
    awake_set: bool = False
    put_to_sleep: int = 0
    """Engines put to sleep by switches (with sets, each displacement puts one or more)."""
    together: int = 0
    """Memory checks that found two or more engines awake on a GPU (with sets)."""
    peak_used_gib: float = 0.0
    checks: int = 0

    def passed(self) -> bool:
        return not (self.violations or self.unanswered or self.unowned or self.stalls
                    or self.lingering or self.timed_out)

    def lines(self) -> list[str]:
        broken, column = (("instants over the GPU's memory or the set's budgets", "violations")
                          if self.awake_set else ("two awake on one GPU", "two-awake instants"))
        out = [f"switches {self.switches} (ok {self.ok}, failed {sum(self.failed.values())}) "
               f"in {self.seconds:.0f} s; engines put to sleep {self.put_to_sleep}; "
               f"controller restarts {self.restarts}",
               f"{broken}: {len(self.violations)} in {self.checks} checks; unanswered: "
               f"{self.unanswered}; GPUs without a true owner: {len(self.unowned)}; longest "
               f"answer {self.longest_answer_s:.2f} s",
               "faults: " + ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items())),
               "failures: " + ", ".join(f"{k} {v}" for k, v in sorted(self.failed.items())),
               *([f"checks with two or more awake on a GPU: {self.together}; the most in use "
                  f"on one GPU: {self.peak_used_gib:.1f} GiB"] if self.awake_set else []),
               f"| GPU | switches (fence moves) | {column} | awake at the end |",
               "|---|---|---|---|"]
        for gpu, row in self.per_gpu.items():
            out.append(f"| {gpu} | {row['fence_moves']} | {row['violations']} | "
                       f"{row['holder'] or '-'} |")
        return out


class SleepCount(SwitchMetrics):
    """The controller's own series, and a count of the engines its switches put to sleep."""

    def __init__(self, report: Report) -> None:
        self.report = report

    def slept(self, model: str, level: int, first: bool, seconds: float) -> None:
        super().slept(model, level, first, seconds)
        self.report.put_to_sleep += 1


class GangCampaign:
    def __init__(self, node: GangNode, session: aiohttp.ClientSession, *,
                 rng: random.Random, report: Report, observer: SleepCount) -> None:
        self.node = node
        self.session = session
        self.rng = rng
        self.report = report
        self.fences0 = {g: node.lease(g).fence for g in node.leases}
        self.observer = observer

    async def stalls(self, stop: asyncio.Event, *, after_s: float = 30.0) -> None:
        """Print every task's stack when no switch ended for ``after_s`` (a campaign
        that stops moving is the finding; its stacks say where)."""
        seen, since = -1, time.monotonic()
        while not stop.is_set():
            await asyncio.sleep(1.0)
            if self.report.switches != seen:
                seen, since = self.report.switches, time.monotonic()
            elif time.monotonic() - since > after_s:
                self.report.stalls += 1
                for task in asyncio.all_tasks():
                    print(f"--- {task.get_name()}", file=sys.stderr)
                    task.print_stack(limit=12, file=sys.stderr)
                since = time.monotonic()

    async def client(self, until: int, stop: asyncio.Event) -> None:
        engines = self.node.engines
        while not stop.is_set() and self.report.switches < until:
            engine = self.rng.choice(engines)
            started = time.monotonic()
            try:
                async with asyncio.timeout(ANSWER_BOUND_S):
                    answer = await self.node.workers[engine.claimant.gpu].activate(
                        engine.claimant)
            except TimeoutError:
                self.report.unanswered += 1
                continue
            spent = time.monotonic() - started
            self.report.longest_answer_s = max(self.report.longest_answer_s, spent)
            if answer.switched or not answer.ok:
                self.report.switches += 1
            if answer.ok:
                self.report.ok += int(answer.switched)
            else:
                self.report.failed[answer.reason or "unknown"] += 1
                await asyncio.sleep(0.01)  # a refused client asks again, not in a spin

    async def faults(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.sleep(self.rng.expovariate(1 / 0.5))
            kind = self.rng.choice(("wake_fails", "sleep_lies", "stranger", "restart"))
            self.report.faults[kind] += 1
            if kind == "restart":
                await self.restart()
                continue
            hold = self.rng.uniform(0.1, 1.0)
            if kind == "stranger":
                gpu = f"gpu-{self.rng.randrange(8)}"
                self.node.device.strangers[gpu] = 2 * 2**30
                await asyncio.sleep(hold)
                self.node.device.strangers.pop(gpu, None)
                continue
            engine = self.rng.choice(self.node.engines)
            await engine.sim.faults(**{kind: True})
            await asyncio.sleep(hold)
            await engine.sim.faults(**{kind: False})

    async def restart(self) -> None:
        """The controller dies in the middle of whatever it does; a new instance takes the
        same Leases and engines (its first steps reconcile every GPU)."""
        old = self.node
        old.stop.set()
        for task in old.tasks:
            task.cancel()
        # Python 3.11's wait_for can swallow a cancellation that meets its inner call's
        # end: such a worker finishes its step first, as an old instance that still acts
        # would (fencing must stop it). Wait for it, bounded, and count it.
        _, lingering = await asyncio.wait(old.tasks, timeout=30.0)
        self.report.lingering += len(lingering)
        for worker in old.workers.values():  # the dead instance's callers see it go
            worker.close("stopping", "the controller died")
        fresh = node_of(old.engines, self.session, old.leases, observer=self.observer,
                        awake_set=self.report.awake_set)
        fresh.device.strangers = old.device.strangers
        fresh.watch = old.watch
        fresh.start()
        self.node = fresh
        self.report.restarts += 1

    async def settle(self) -> None:
        """No fault left: every GPU reconciles; a lying engine is put to sleep for real."""
        for engine in self.node.engines:
            await engine.sim.faults(wake_fails=False, sleep_lies=False)
        self.node.device.strangers.clear()
        for _ in range(3):
            for worker in self.node.workers.values():
                worker.mark_dirty()
            for _ in range(200):
                await asyncio.sleep(0.01)
                if not any(w._dirty or w.unsettled for w in self.node.workers.values()):
                    break

    def verdict(self) -> None:
        node, report = self.node, self.report
        report.violations = list(node.watch.violations)
        report.checks = node.watch.checks
        if isinstance(node.watch, AwakeSetWatch):
            report.together = node.watch.together
            report.peak_used_gib = node.watch.peak_used / 2**30
        for gpu in sorted(node.leases, key=lambda g: int(g.rpartition("-")[2])):
            lease = node.lease(gpu)
            awake = {e.claimant.claim_uid: e.claimant.ref
                     for e in node.engines if e.awake_on(gpu)}
            named = {m.uid: m.claim for m in lease.awake_set}
            one = len(awake) <= 1 or report.awake_set
            if not one or set(named) != set(awake) or lease.state in (
                    naming.STATE_SWITCHING, naming.STATE_STARTING):
                report.unowned.append(f"{gpu}: Lease {lease.state} {sorted(named.values())}, "
                                      f"awake {sorted(awake.values())}")
            report.per_gpu[gpu] = {
                "fence_moves": lease.fence - self.fences0[gpu],
                "violations": sum(1 for v in report.violations if v.startswith(f"{gpu}:")),
                "holder": " + ".join(sorted(named.values()))}


async def run(*, switches: int, seed: int, clients: int = 6,
              max_seconds: float = 1800.0, awake_set: bool = False) -> Report:
    rng = random.Random(seed)
    report = Report(awake_set=awake_set)
    begin = time.monotonic()
    async with aiohttp.ClientSession(connector=engine_connector()) as session:
        observer = SleepCount(report)
        node = await gang_node(start_sim, session, SET_MIX if awake_set else NODE_MIX, gpus=8,
                               observer=observer, awake_set=awake_set)
        campaign = GangCampaign(node, session, rng=rng, report=report, observer=observer)
        stop = asyncio.Event()
        faults = asyncio.create_task(campaign.faults(stop))
        watchdog = asyncio.create_task(campaign.stalls(stop))
        try:
            async with asyncio.timeout(max_seconds):
                await asyncio.gather(*(campaign.client(switches, stop)
                                       for _ in range(clients)))
        except TimeoutError:
            report.timed_out = True
        finally:
            stop.set()
            faults.cancel()
            watchdog.cancel()
            await asyncio.gather(faults, watchdog, return_exceptions=True)
        await campaign.settle()
        campaign.verdict()
        await campaign.node.close()
        for engine in campaign.node.engines:
            await engine.sim.stop()
    report.seconds = time.monotonic() - begin
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.chaos.gangs",
        description="Tensor-parallel and one-GPU engines taking turns on an 8-GPU node under "
                    "faults, through the controller's gang switches; exits 1 when two "
                    "engines were ever awake on one GPU (--awake-set: a GPU's memory over its "
                    "total, or more engines awake than their budgets fit), an activation went "
                    "unanswered, or a GPU ended without a true owner.")
    parser.add_argument("--switches", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--awake-set", action="store_true",
                        help="the controller with awake sets, on a mix made for them: three "
                             "one-GPU engines on each of six GPUs (any two fit awake, three "
                             "never), a TP=2 engine on the last two")
    parser.add_argument("--max-seconds", type=float, default=1800.0)
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # the report is the output; faults log a lot
    report = asyncio.run(run(switches=args.switches, seed=args.seed, clients=args.clients,
                             max_seconds=args.max_seconds, awake_set=args.awake_set))
    if args.json:
        print(json.dumps(report.__dict__, default=dict, indent=1))
    else:
        mix = SET_MIX if args.awake_set else NODE_MIX
        print("engines: " + ", ".join(f"{n} {'+'.join(g)} {gib} GiB" for n, g, gib in mix))
        print("\n".join(report.lines()))
    return 0 if report.passed() else 1


if __name__ == "__main__":
    raise SystemExit(main())
