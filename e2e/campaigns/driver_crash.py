"""The driver crash campaign: prepares and unprepares on a failing disk, cancelled at random
points, the driver dying at random calls; after every round the driver restarts and its
ledger, CDI specs and answers must agree.

    python -m e2e.campaigns.driver_crash [--rounds 1000] [--seed 20261201] [--claims 8]

Each round runs one driver incarnation (the real :class:`driver.prepare.Preparer`, claims
read from the local cluster's API server) on a :mod:`e2e.harness.disk_simulator` disk that fails
calls at random with ENOSPC or EIO, sometimes stays full, and sometimes crashes at a
random call. A kubelet sends up to three calls at once on disjoint claims, each cancelled
at a random instant with some probability (its deadline, as the kubelet's 45 s deadline
cancels a call), and sometimes another driver process holds the node lock for a while.
Then a new incarnation on a healthy disk restores and the files are checked:

- inconsistencies: half-done records, records without a CDI spec, specs without a record,
  temp files, claims answered prepared but not on disk, answers naming another share than
  the claim's allocation (the scheduler allocates a claim anew now and then) (target 0);
- over-commits: resident budgets beyond the GPU, or a claim that could not wake beside
  every other resident (target 0);
- leaked records: claims the kubelet last unprepared successfully that still have a
  record or spec, and at the end, whatever is left after the kubelet unprepared every
  claim on a healthy disk (target 0).

Prints one line per quantity and a JSON object last; exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import random
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kubernetes import client

from driver.ledger import file_lock
from driver.prepare import ClaimRef, Preparer
from e2e.harness.disk_simulator import DiskSimulator, SimulatedCrash
from e2e.harness.objects import read_claim
from e2e.harness.preparing import (
    NodeFiles,
    allocated_claim,
    node_devices,
    overcommits,
    set_allocation,
)
from e2e.harness.waiting import eventually_async
from rota.kit.kube import Kube

GPU_BYTES = 150754820096  # the fake H200
Expected = Literal["prepared", "unprepared", "unknown"]
Verb = Literal["prepare", "unprepare"]


@dataclass
class Report:
    """What a campaign did and found."""

    rounds: int = 0
    calls: Counter[str] = field(default_factory=Counter)
    faults: int = 0
    crashes: int = 0
    lock_holds: int = 0
    reallocations: int = 0
    inconsistencies: list[str] = field(default_factory=list)
    overcommits: list[str] = field(default_factory=list)
    leaked: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.inconsistencies or self.overcommits or self.leaked)

    def lines(self) -> list[str]:
        calls = ", ".join(f"{k} {v}" for k, v in sorted(self.calls.items()))
        return [
            f"rounds: {self.rounds} ({self.seconds:.1f} s)",
            f"calls: {sum(self.calls.values())} ({calls})",
            f"injected: {self.faults} I/O errors, {self.crashes} crashes, "
            f"{self.lock_holds} lock holds by another driver process, "
            f"{self.reallocations} claims allocated anew",
            f"ledger/CDI inconsistencies: {len(self.inconsistencies)} (target 0)",
            f"over-commits: {len(self.overcommits)} (target 0)",
            f"leaked records: {len(self.leaked)} (target 0)",
            *(f"  {p}" for p in (self.inconsistencies + self.overcommits + self.leaked)[:20]),
        ]

    def summary(self) -> dict[str, object]:
        return {"rounds": self.rounds, "calls": dict(self.calls), "io_errors": self.faults,
                "crashes": self.crashes, "lock_holds": self.lock_holds,
                "reallocations": self.reallocations,
                "inconsistencies": len(self.inconsistencies),
                "overcommits": len(self.overcommits), "leaked_records": len(self.leaked),
                "seconds": round(self.seconds, 1)}


@dataclass
class _Call:
    verb: Verb
    refs: list[ClaimRef]
    cancel_after_s: float | None


def _true(check: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def holds() -> bool:
        return check()

    return holds


class Campaign:
    """One node's driver under the campaign; see the module docstring."""

    def __init__(self, *, api: client.ApiClient, refs: Sequence[ClaimRef], pool: str,
                 root: Path, rng: random.Random, shares: dict[str, str]) -> None:
        self.api = api
        self.kube = Kube(api)
        self.shares = shares  # uid -> the share id the claim is allocated now
        self.refs = list(refs)
        self.pool = pool
        self.files = NodeFiles(root)
        self.devices = node_devices(pool)
        self.rng = rng
        self.expected: dict[str, Expected] = {ref.uid: "unprepared" for ref in refs}
        self.report = Report()

    def _preparer(self, disk: DiskSimulator | None = None) -> Preparer:
        if disk is None:
            return self.files.preparer(self.kube, self.devices, pool=self.pool)
        return self.files.preparer(self.kube, self.devices, pool=self.pool, disk=disk,
                                   lock_timeout_s=0.2)

    def _disk(self) -> DiskSimulator:
        disk = DiskSimulator(rng=random.Random(self.rng.random()))
        rate = self.rng.choice((0.0, 0.01, 0.03, 0.08))
        if rate:
            disk.fail_randomly(rate)
        if self.rng.random() < 0.1:  # the disk fills up and stays full
            disk.fail_at(self.rng.randrange(60), errno.ENOSPC, sticky=True)
        if self.rng.random() < 0.15:
            disk.crash_at(self.rng.randrange(120))
        return disk

    def _calls(self) -> list[_Call]:
        uids = list(self.refs)
        self.rng.shuffle(uids)
        calls = []
        for _ in range(self.rng.randint(1, 3)):
            if not uids:
                break
            size = self.rng.randint(1, min(3, len(uids)))
            batch, uids = uids[:size], uids[size:]
            cancel = self.rng.uniform(0.0, 0.02) if self.rng.random() < 0.35 else None
            calls.append(_Call(self.rng.choice(("prepare", "unprepare")), batch, cancel))
        return calls

    async def _send(self, preparer: Preparer, call: _Call) -> None:
        """One kubelet call; updates what each claim is expected to be."""
        deadline = None if call.cancel_after_s is None else (
            time.monotonic() + call.cancel_after_s)
        if call.verb == "prepare":
            work: asyncio.Future[object] = asyncio.ensure_future(
                preparer.prepare(call.refs, deadline=deadline))
        else:
            work = asyncio.ensure_future(preparer.unprepare(call.refs, deadline=deadline))
        timer = None
        if call.cancel_after_s is not None:  # the kubelet's deadline
            timer = asyncio.get_running_loop().call_later(call.cancel_after_s, work.cancel)
        try:
            outcomes = await work
        except asyncio.CancelledError:
            self.report.calls[f"{call.verb} cancelled"] += 1
            self._unknown(call.refs)
            if self.rng.random() < 0.5:  # the kubelet moves on at once: the next call
                verb: Verb = self.rng.choice(("prepare", "unprepare"))
                await self._send(preparer, _Call(verb, call.refs, None))
            return
        except SimulatedCrash:
            self.report.calls[f"{call.verb} crashed"] += 1
            self._unknown(call.refs)
            return
        finally:
            if timer is not None:
                timer.cancel()
        assert isinstance(outcomes, dict)
        for ref in call.refs:
            outcome = outcomes[ref.uid]
            failed = isinstance(outcome, Exception)
            self.report.calls[f"{call.verb} {'error' if failed else 'ok'}"] += 1
            if not failed:
                self.expected[ref.uid] = "prepared" if call.verb == "prepare" else "unprepared"
            if not failed and call.verb == "prepare":
                answered = [d.share_id for d in outcome]
                if answered != [self.shares[ref.uid]]:
                    self.report.inconsistencies.append(
                        f"round {self.report.rounds}: {ref.uid} answered share {answered}, "
                        f"allocated {self.shares[ref.uid]}")
            elif call.verb == "unprepare":
                # The record may be gone with the spec still there (removed at restore).
                self.expected[ref.uid] = "unknown"
            # A failed prepare leaves the claim as it was.

    def _unknown(self, refs: Sequence[ClaimRef]) -> None:
        for ref in refs:
            self.expected[ref.uid] = "unknown"

    def _hold_lock(self, held: threading.Event, release: threading.Event) -> None:
        with file_lock(self.files.lock_path, timeout_s=5.0):
            held.set()
            release.wait(5.0)

    async def _allocate_anew(self) -> None:
        """The scheduler allocates a claim the kubelet is not known to hold again, to
        another share (its pod was deleted, a new one came): a record the driver still
        has for it must not be answered."""
        free = [ref for ref in self.refs if self.expected[ref.uid] != "prepared"]
        if not free:
            return
        ref = self.rng.choice(free)
        body = await asyncio.to_thread(set_allocation, self.api, ref.namespace, ref.name,
                                       pool=self.pool)
        self.shares[ref.uid] = body["status"]["allocation"]["devices"]["results"][0]["shareID"]
        self.report.reallocations += 1

    async def round(self) -> None:
        if self.rng.random() < 0.05:
            await self._allocate_anew()
        disk = self._disk()
        preparer = self._preparer(disk)
        holder = None
        release = threading.Event()
        if self.rng.random() < 0.2:  # another driver process (a rolling update) holds it
            self.report.lock_holds += 1
            held = threading.Event()
            holder = asyncio.ensure_future(asyncio.to_thread(self._hold_lock, held, release))
            await asyncio.to_thread(held.wait, 5.0)
            asyncio.get_running_loop().call_later(self.rng.uniform(0.0, 0.05), release.set)
        try:
            await asyncio.gather(*(self._send(preparer, call) for call in self._calls()))
        finally:
            release.set()
            if holder is not None:
                await holder
        # Every call has returned; a worker thread still inside the lock now would be one
        # a cancelled call left running.
        await eventually_async(_true(lambda: disk.open_locks == 0 or disk.crashed),
                               timeout=30, interval=0.001, what="worker threads done")
        self.report.faults += len(disk.failures)
        self.report.crashes += int(disk.crashed)
        await self._restart_and_check()
        self.report.rounds += 1

    async def _restart_and_check(self) -> None:
        preparer = self._preparer()
        await preparer.restore()
        where = f"round {self.report.rounds}"
        problems = self.files.problems(GPU_BYTES)
        over = overcommits(self.files.records(), GPU_BYTES)
        self.report.overcommits += [f"{where}: {p}" for p in over]
        self.report.inconsistencies += [f"{where}: {p}" for p in problems if p not in over]
        records, specs = self.files.records(), self.files.specs()
        for uid, expected in self.expected.items():
            present = uid in records or uid in specs
            if expected == "prepared" and not (uid in records and uid in specs):
                self.report.inconsistencies.append(f"{where}: {uid} answered prepared, "
                                                   "not on disk")
            elif expected == "unprepared" and present:
                self.report.leaked.append(f"{where}: {uid} answered unprepared, still there")
            if expected == "unknown":  # settled by what is on disk now
                self.expected[uid] = "prepared" if uid in records else "unprepared"

    async def finish(self) -> None:
        """The kubelet unprepares every claim, on a healthy disk: nothing may be left."""
        outcomes = await self._preparer().unprepare(self.refs)
        self.report.inconsistencies += [f"final unprepare of {uid}: {e}"
                                        for uid, e in outcomes.items() if e is not None]
        self.report.leaked += [f"after the final unprepare: {uid}"
                               for uid in set(self.files.records()) | self.files.specs()]


async def run_campaign(api: client.ApiClient, namespace: str, root: Path, *, rounds: int,
                       seed: int, claims: int = 8) -> Report:
    """Create ``claims`` allocated claims in ``namespace`` and run ``rounds`` rounds."""
    rng = random.Random(seed)
    pool = f"campaign-{uuid.uuid4().hex[:8]}"
    refs = [allocated_claim(api, namespace, f"c{i}", pool=pool, memory="12Gi",
                            awake=f"{40 + 10 * (i % 4)}Gi") for i in range(claims)]
    shares = {}
    for ref in refs:
        claim = await asyncio.to_thread(read_claim, api, namespace, ref.name)
        shares[ref.uid] = claim["status"]["allocation"]["devices"]["results"][0]["shareID"]
    campaign = Campaign(api=api, refs=refs, pool=pool, root=root, rng=rng, shares=shares)
    started = time.perf_counter()
    for _ in range(rounds):
        await campaign.round()
    await campaign.finish()
    campaign.report.seconds = time.perf_counter() - started
    return campaign.report


def main(argv: list[str] | None = None) -> int:
    import logging
    import tempfile

    from e2e.cluster import LocalCluster

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=20261201)
    parser.add_argument("--claims", type=int, default=8)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)  # the driver's warnings are expected here
    cluster = LocalCluster()
    try:
        cluster.start()
        api = cluster.api_client()
        namespace = f"campaign-{uuid.uuid4().hex[:8]}"
        client.CoreV1Api(api).create_namespace({"metadata": {"name": namespace}})
        with tempfile.TemporaryDirectory(prefix="rota-campaign-") as root:
            report = asyncio.run(run_campaign(api, namespace, Path(root), rounds=args.rounds,
                                              seed=args.seed, claims=args.claims))
        with contextlib.suppress(client.ApiException):
            client.CoreV1Api(api).delete_namespace(namespace)
        api.close()
    finally:
        cluster.cleanup()
    for line in report.lines():
        print(line)
    print(json.dumps(report.summary()))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
