"""The JSON summary of the one-GPU switch benchmark (pure: the run's records in, a dict
out). Timings follow the reference experiment's boundaries (DESIGN.md); a handoff that
held an engine's first sleep is left out of handoff-to-first-token and sleep, and its
first sleep is reported on its own."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

from e2e.bench.stats import summary_s
from e2e.gpu.context import ASSUMED_H2D_BYTES_PER_S
from e2e.gpu.switch_run import Run

__all__ = ["note", "summary", "timing_block", "values"]


def note(fake: bool, *, gang: bool = False) -> str:
    nvml = "FAKE NVML backend (fixture)" if fake else "real NVML backend (pynvml)"
    switcher = "real GangSwitcher, Switcher" if gang else "real Switcher"
    ports = "one in-memory lease port per GPU" if gang else "in-memory lease port"
    return (f"switch protocol run WITHOUT a Kubernetes cluster: {nvml} behind the driver's "
            f"inspection service on a unix socket, {switcher} and engine adapters, "
            f"claimants built by hand, {ports}")


def values(key: str, rows: Sequence[dict[str, Any]]) -> list[float]:
    return [float(e[key]) for e in rows if e.get(key) is not None]


def timing_block(entries: Sequence[dict[str, Any]], *, with_sleep: bool) -> dict[str, Any]:
    """Stats of successful handoffs; handoff-to-first-token and sleep leave out the handoffs
    that held a first sleep (reported on their own, as the reference experiment does)."""
    ok = [e for e in entries if e["ok"]]
    steady = [e for e in ok if not e["first_sleep"]]
    block = {
        "handoff_to_first_token": summary_s(values("handoff_to_first_token_s", steady)),
        "wake_call": summary_s(values("wake_call_s", ok)),
        "recovery_to_first_token": summary_s(values("recovery_to_first_token_s", ok)),
        "probe_ttft": summary_s(values("probe_ttft_s", ok)),
        "wake_over_floor": summary_s(values("wake_over_floor", ok)),
    }
    if with_sleep:
        block["sleep"] = summary_s(values("sleep_s", steady))
    return block


def _floors(run: Run) -> dict[str, Any]:
    ok_handoffs = [h for h in run.handoffs if h["ok"]]
    bandwidth = run.h2d.get("bytes_per_s") or ASSUMED_H2D_BYTES_PER_S
    floors: dict[str, Any] = {}
    for sim in run.sims:
        wakes = [h["wake_call_s"] for h in ok_handoffs
                 if h["to"] == sim.key and h.get("wake_call_s") is not None]
        copies = [h["simulator_copy_s"] for h in ok_handoffs
                  if h["to"] == sim.key and h.get("simulator_copy_s") is not None]
        floor = sim.weights / sim.tp / bandwidth  # each GPU copies its own shard
        p50 = summary_s(wakes)["p50"]
        floors[sim.key] = {
            "weights_bytes": sim.weights, "floor_s": round(floor, 4),
            "wake_call_p50_s": p50, "simulator_copy_p50_s": summary_s(copies)["p50"],
            "ratio_p50": round(p50 / floor, 3) if p50 is not None and floor > 0 else None,
            "ratio_max": (round(max(wakes) / floor, 3) if wakes and floor > 0 else None)}
    return floors


def common(run: Run, args: argparse.Namespace, started: float, error: str | None,
           *, ok: bool, gang: bool) -> dict[str, Any]:
    """The keys both summaries share."""
    return {
        "benchmark": "gpu_switch",
        "cluster": False,
        "note": note(bool(args.fake_nvml), gang=gang),
        "ok": error is None and not run.failures and ok,
        "error": error,
        "device": run.gpu.product_name if run.gpu else None,
        "gpu_uuid": run.gpu.uuid if run.gpu else None,
        "nvml": "fake" if args.fake_nvml else "real",
        "memory_backend": args.memory_backend,
        "engines": {s.key: {"model": s.model, "tensor_parallel": s.tp, "awake_bytes": s.awake,
                            "resident_bytes": s.resident, "weights_bytes": s.weights,
                            "kv_cache_bytes": s.awake - s.resident - s.weights}
                    for s in run.sims},
        "handoffs_requested": args.handoffs,
        "failures": run.failures,
        "first_sleep_s": run.first_sleep_s,
        "memory_mib": run.phases,
        "h2d": run.h2d,
        "wake_floor": _floors(run),
        "limits": {"resident_tolerance_bytes": args.resident_tolerance,
                   "unknown_limit_bytes": args.unknown_limit,
                   "context_allowance_bytes": args.context_allowance},
        "lease_writes": run.lease_writes,
    }


def summary(run: Run, args: argparse.Namespace, started: float, error: str | None
            ) -> dict[str, Any]:
    """The one-GPU run's JSON line."""
    ok_handoffs = [h for h in run.handoffs if h["ok"]]
    first_handoffs = [h for h in ok_handoffs if h["first_sleep"]]
    return common(run, args, started, error, ok=len(ok_handoffs) == args.handoffs,
                  gang=False) | {
        "handoffs_ok": len(ok_handoffs),
        "first_sleep_handoff_to_first_token_s": [h["handoff_to_first_token_s"]
                                                 for h in first_handoffs],
        "timings_s": timing_block(run.handoffs, with_sleep=True),
        "timings_by_target_s": {s.key: timing_block([h for h in run.handoffs
                                                     if h["to"] == s.key], with_sleep=False)
                                for s in run.sims},
        "later_sleep_by_model_s": {
            s.key: summary_s(values("sleep_s", [h for h in run.handoffs if h["ok"]
                                                and h["from"] == s.key
                                                and not h["first_sleep"]]))
            for s in run.sims},
        "throughput": run.throughput,
        "handoffs": run.handoffs,
        "wall_s": round(time.monotonic() - started, 2),
    }
