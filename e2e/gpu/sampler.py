"""The one-awake invariant, watched on the device itself: NVML sampled every few ms.

A thread reads the GPU's memory and compute processes through the driver's NVML backend
(real or fake) every ``interval_s`` (5 ms by default; a read takes microseconds), attributes
each process to an engine by the ``ROTA_CLAIM_UID`` in its environment, as the inspection
service does, and counts the engines above their resident limit (resident budget plus the
controller's tolerance). A sample with more of them than the current phase allows is a
violation: in a switch, one; while an engine starts beside an awake one because both fit,
two. A phase of an awake set (``set_budget_bytes``) also checks the set itself: the awake
budgets of the engines above resident together within the set's budget (the GPU's memory),
and no engine above its own awake budget. Scenarios name their phases; the report says per
phase how many samples were taken, the most engines seen above resident at once, and the
first violations, and it keeps a thinned timeline (a point whenever an engine's memory moved
by 256 MiB, or every second).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from driver.inspection import process_environment
from driver.nvml.api import NvmlBackend

__all__ = ["NvmlSampler", "PhaseStats"]

MIB = 2**20


@dataclass
class PhaseStats:
    """What the samples of one phase showed."""

    label: str
    allowed_above: int
    started: float
    samples: int = 0
    max_above: int = 0
    violations: int = 0
    first_violations: list[dict[str, Any]] = field(default_factory=list)
    peak_used_bytes: int = 0
    set_budget_bytes: int | None = None
    """Where several may be awake: what their awake budgets may add up to."""
    peak_set_budget_bytes: int = 0
    ended: float | None = None

    def as_dict(self, origin: float) -> dict[str, Any]:
        return {"label": self.label, "allowed_above_resident": self.allowed_above,
                "start_s": round(self.started - origin, 3),
                "end_s": None if self.ended is None else round(self.ended - origin, 3),
                "samples": self.samples, "max_engines_above_resident": self.max_above,
                "violations": self.violations, "first_violations": self.first_violations,
                "peak_used_mib": round(self.peak_used_bytes / MIB, 1),
                "set_budget_mib": None if self.set_budget_bytes is None
                else round(self.set_budget_bytes / MIB, 1),
                "peak_set_budgets_mib": round(self.peak_set_budget_bytes / MIB, 1)}


class NvmlSampler:
    """Samples one GPU in a thread; every public method is thread-safe."""

    def __init__(self, backend: NvmlBackend, gpu_index: int, *, interval_s: float = 0.005,
                 proc_root: Path = Path("/proc"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.gpu_index = gpu_index
        self.interval_s = interval_s
        self.proc_root = proc_root
        self.clock = clock
        self.origin = clock()
        self._lock = threading.Lock()
        self._limits: dict[str, tuple[str, int]] = {}  # key -> (claim uid, resident limit)
        self._awake_limits: dict[str, int] = {}         # key -> awake budget
        self._claims: dict[int, str] = {}              # pid -> claim uid (environ cache)
        self._phases: list[PhaseStats] = [PhaseStats("idle", 1, self.origin)]
        self._timeline: list[list[Any]] = []
        self._last_point: tuple[float, dict[str, int]] = (0.0, {})
        self._intervals: list[float] = []
        self._errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.max_timeline = 20000

    # -- configuration ---------------------------------------------------------------

    def watch(self, key: str, claim_uid: str, resident_limit_bytes: int,
              awake_limit_bytes: int | None = None) -> None:
        """Attribute ``claim_uid``'s processes to ``key``; above ``resident_limit_bytes`` it
        counts as awake, above ``awake_limit_bytes`` (where given) it is over its budget."""
        with self._lock:
            self._limits[key] = (claim_uid, resident_limit_bytes)
            if awake_limit_bytes is not None:
                self._awake_limits[key] = awake_limit_bytes

    def unwatch(self, key: str) -> None:
        with self._lock:
            self._limits.pop(key, None)
            self._awake_limits.pop(key, None)

    def phase(self, label: str, *, allowed_above: int = 1,
              set_budget_bytes: int | None = None) -> None:
        """Start a new phase: samples from now on are checked against ``allowed_above``
        and, for an awake set, ``set_budget_bytes``."""
        now = self.clock()
        with self._lock:
            self._phases[-1].ended = now
            self._phases.append(PhaseStats(label, allowed_above, now,
                                           set_budget_bytes=set_budget_bytes))

    # -- the thread --------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _claim_of(self, pid: int) -> str:
        claim = self._claims.get(pid)
        if claim is None:
            claim = process_environment(pid, self.proc_root).get("ROTA_CLAIM_UID", "")
            if claim:  # an unattributed pid is read again: it may be starting
                self._claims[pid] = claim
        return claim

    def _run(self) -> None:
        previous: float | None = None
        while not self._stop.is_set():
            began = self.clock()
            try:
                self.sample_once()
            except Exception as exc:  # an NVML hiccup must not end the watch
                if len(self._errors) < 20:
                    self._errors.append(f"{type(exc).__name__}: {exc}")
            if previous is not None and len(self._intervals) < 500_000:
                self._intervals.append(began - previous)
            previous = began
            self._stop.wait(max(0.0, self.interval_s - (self.clock() - began)))

    def sample_once(self) -> dict[str, int]:
        """Take one sample now; the bytes each watched engine holds."""
        memory = self.backend.memory_info(self.gpu_index)
        processes = self.backend.compute_processes(self.gpu_index)
        now = self.clock()
        with self._lock:
            by_claim: dict[str, int] = {}
            for proc in processes:
                claim = self._claim_of(proc.pid)
                # A size NVML cannot tell adds nothing to a sample (a measurement, not
                # the check before a wake, which refuses it).
                by_claim[claim] = by_claim.get(claim, 0) + (proc.used_bytes or 0)
            known = {uid for uid, _ in self._limits.values()}
            usage = {key: by_claim.get(uid, 0) for key, (uid, _) in self._limits.items()}
            unknown = sum(v for uid, v in by_claim.items() if uid not in known)
            above = sorted(key for key, (_, limit) in self._limits.items()
                           if usage[key] > limit)
            stats = self._phases[-1]
            stats.samples += 1
            stats.max_above = max(stats.max_above, len(above))
            stats.peak_used_bytes = max(stats.peak_used_bytes, memory.used)
            wrong = self._set_faults(stats, above, usage)
            if len(above) > stats.allowed_above:
                wrong.insert(0, f"{len(above)} above resident, {stats.allowed_above} allowed")
            if wrong:
                stats.violations += 1
                if len(stats.first_violations) < 10:
                    stats.first_violations.append({
                        "t_s": round(now - self.origin, 4), "above": above, "why": wrong,
                        "mib": {k: round(usage[k] / MIB, 1) for k in above}})
            self._thin(now, usage, unknown, memory.used, stats.label)
        return usage

    def _set_faults(self, stats: PhaseStats, above: list[str], usage: dict[str, int]
                    ) -> list[str]:
        """What is wrong with the awake set of one sample (nothing outside a set's phase)."""
        if stats.set_budget_bytes is None:
            return []
        budgets = sum(self._awake_limits.get(k, usage[k]) for k in above)
        stats.peak_set_budget_bytes = max(stats.peak_set_budget_bytes, budgets)
        wrong = [f"{k} holds {usage[k] / MIB:.0f} MiB over its awake budget of "
                 f"{self._awake_limits[k] / MIB:.0f} MiB" for k in above
                 if k in self._awake_limits and usage[k] > self._awake_limits[k]]
        if budgets > stats.set_budget_bytes:
            wrong.append(f"the awake budgets add up to {budgets / MIB:.0f} MiB, over the "
                         f"set's {stats.set_budget_bytes / MIB:.0f} MiB")
        return wrong

    def _thin(self, now: float, usage: dict[str, int], unknown: int, used: int,
              label: str) -> None:
        last_t, last = self._last_point
        moved = any(abs(v - last.get(k, 0)) >= 256 * MIB for k, v in usage.items())
        if (moved or now - last_t >= 1.0 or usage.keys() != last.keys()) and \
                len(self._timeline) < self.max_timeline:
            self._timeline.append([round(now - self.origin, 4), round(used / MIB),
                                   {k: round(v / MIB) for k, v in usage.items()},
                                   round(unknown / MIB), label])
            self._last_point = (now, dict(usage))

    # -- results -----------------------------------------------------------------------

    def phases(self) -> list[dict[str, Any]]:
        with self._lock:
            return [p.as_dict(self.origin) for p in self._phases]

    def phase_stats(self, label: str) -> dict[str, Any] | None:
        """The last phase called ``label``."""
        with self._lock:
            for stats in reversed(self._phases):
                if stats.label == label:
                    return stats.as_dict(self.origin)
        return None

    def report(self) -> dict[str, Any]:
        with self._lock:
            intervals = sorted(self._intervals)
            phases = [p.as_dict(self.origin) for p in self._phases]
            timeline = list(self._timeline)
            errors = list(self._errors)

        def at(q: float) -> float | None:
            if not intervals:
                return None
            return round(intervals[min(len(intervals) - 1, int(q * len(intervals)))] * 1e3, 3)

        return {
            "interval_target_ms": round(self.interval_s * 1e3, 3),
            "samples": sum(p["samples"] for p in phases),
            "interval_ms": {"p50": at(0.5), "p99": at(0.99),
                            "max": round(intervals[-1] * 1e3, 3) if intervals else None},
            "violations": sum(p["violations"] for p in phases),
            "phases": phases,
            "errors": errors,
            "timeline_columns": ["t_s", "used_mib", "engines_mib", "unknown_mib", "phase"],
            "timeline": timeline,
        }
