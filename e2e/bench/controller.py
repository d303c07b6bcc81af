"""Benchmark of the lease controller's own overhead on the local cluster.

    python -m e2e.bench.controller [--handoffs 40] [--later-sleep 0.05] [--wake 0.1]
                                   [--ttft 0.02]

A GPU node with the driver, the node agent and one lease controller; two simulated engines
on its fake GPU, configured with known delays (sleep, level-1 wake, time to first token).
Handoffs A <-> B go through the activation API. For each handoff:

- controller overhead = the controller's own ``handoff_to_first_token`` (sleep call and
  its confirmation, the GPU read, the wake and its confirmation, the correctness request
  up to its first token) minus the configured sleep + wake + time to first token;
- round-trip overhead = the activation call as the client saw it (Lease writes, drain,
  claimant reads and HTTP included) minus the same floor.

The first sleep of each simulator is set to the later sleep, and two warm-up handoffs (one
onto each engine) run before the measured ones and are reported apart, so every measured
handoff has the same floor. Prints one line per measurement and a JSON object last.
Targets (controller overhead): p50 <= 20 ms, p99 <= 80 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes import client

from e2e.bench.stats import summary_ms
from e2e.cluster import LocalCluster
from e2e.harness.local_node import engine_node
from e2e.harness.scenario import EngineSpec, activate, deploy
from e2e.harness.waiting import eventually_async

TARGET_P50_MS = 20.0
TARGET_P99_MS = 80.0
WARMUP_HANDOFFS = 2
ACTIVATION_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Delays:
    """What each simulator is told to take, in seconds."""

    later_sleep_s: float = 0.05
    wake_s: float = 0.1
    ttft_s: float = 0.02

    @property
    def floor_s(self) -> float:
        return self.later_sleep_s + self.wake_s + self.ttft_s

    def args(self) -> tuple[str, ...]:
        return (f"--first-sleep-seconds={self.later_sleep_s}",
                f"--later-sleep-seconds={self.later_sleep_s}",
                f"--wake-level1-seconds={self.wake_s}", f"--ttft-seconds={self.ttft_s}")


@dataclass(frozen=True)
class Handoff:
    target: str
    round_trip_s: float
    timings: dict[str, float]


async def _handoffs(url: str, models: tuple[str, str], count: int) -> list[Handoff]:
    """Wait for the controller, make ``models[0]`` awake, then ``count`` handoffs."""
    done: list[Handoff] = []
    async with aiohttp.ClientSession() as session:
        async def serving() -> bool:
            status, _ = await activate(session, url, models[0], timeout_s=ACTIVATION_TIMEOUT_S)
            return status == 200

        await eventually_async(serving, timeout=90, what="controller serving")
        for i in range(count):
            target = models[(i + 1) % 2]
            start = time.perf_counter()
            status, body = await activate(session, url, target, timeout_s=ACTIVATION_TIMEOUT_S)
            elapsed = time.perf_counter() - start
            if status != 200 or not body.get("switched"):
                raise RuntimeError(f"handoff {i} to {target} failed: {status} {body}")
            done.append(Handoff(target, elapsed, dict(body["timings"])))
    return done


def run(cluster: LocalCluster, api: client.ApiClient, *, handoffs: int = 40,
        delays: Delays | None = None, namespace: str | None = None) -> dict[str, Any]:
    """Run the benchmark on ``cluster`` with a node of its own; returns the result object
    (``targets_met`` included). The node and its processes are stopped before returning."""
    if handoffs < 2:
        raise ValueError("at least 2 handoffs are needed")
    delays = delays or Delays()
    with engine_node(cluster, api, prefix="bench", namespace=namespace) as (node, ns):
        specs = [EngineSpec(f"engine-{x}", f"bench/model-{x}", resident="1Gi", awake="20Gi",
                            args=delays.args()) for x in "ab"]
        deploy(api, ns, node.name, specs)
        node.start_controller()
        models = (specs[0].model, specs[1].model)
        all_handoffs = asyncio.run(_handoffs(node.controller_url(), models,
                                             WARMUP_HANDOFFS + handoffs))
    return summarise(all_handoffs[:WARMUP_HANDOFFS], all_handoffs[WARMUP_HANDOFFS:], delays)


def summarise(warmup: list[Handoff], measured: list[Handoff], delays: Delays
              ) -> dict[str, Any]:
    floor = delays.floor_s
    controller = [h.timings["handoff_to_first_token"] - floor for h in measured]
    round_trip = [h.round_trip_s - floor for h in measured]
    steps = sorted({k for h in measured for k in h.timings})
    step_p50 = {k: round(statistics.median(h.timings[k] for h in measured if k in h.timings)
                         * 1e3, 2) for k in steps}
    result: dict[str, Any] = {
        "handoffs": len(measured),
        "warmup_handoffs": len(warmup),
        "configured_s": {"sleep": delays.later_sleep_s, "wake_level1": delays.wake_s,
                         "ttft": delays.ttft_s, "floor": round(floor, 4)},
        "controller_overhead": summary_ms(controller),
        "round_trip_overhead": summary_ms(round_trip),
        "warmup_controller_overhead_ms": [
            round((h.timings["handoff_to_first_token"] - floor) * 1e3, 2) for h in warmup],
        "step_p50_ms": step_p50,
        "step_overhead_p50_ms": {
            "sleep": round(step_p50.get("later_sleep", 0.0) - delays.later_sleep_s * 1e3, 2),
            "wake": round(step_p50.get("wake_call", 0.0) - delays.wake_s * 1e3, 2),
            "ttft": round(step_p50.get("probe_ttft", 0.0) - delays.ttft_s * 1e3, 2)},
    }
    result["targets_met"] = (result["controller_overhead"]["p50_ms"] <= TARGET_P50_MS
                             and result["controller_overhead"]["p99_ms"] <= TARGET_P99_MS)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.controller",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--handoffs", type=int, default=40,
                        help="measured handoffs, after 2 warm-up ones (default 40)")
    parser.add_argument("--later-sleep", type=float, default=0.05,
                        help="simulators' sleep time in seconds, first sleep too (0.05)")
    parser.add_argument("--wake", type=float, default=0.1,
                        help="simulators' level-1 wake time in seconds (0.1)")
    parser.add_argument("--ttft", type=float, default=0.02,
                        help="simulators' time to first token in seconds (0.02)")
    args = parser.parse_args(argv)
    delays = Delays(later_sleep_s=args.later_sleep, wake_s=args.wake, ttft_s=args.ttft)
    cluster = LocalCluster()
    try:
        with cluster:
            api = cluster.api_client()
            try:
                result = run(cluster, api, handoffs=args.handoffs, delays=delays)
            finally:
                api.close()
    finally:
        cluster.cleanup()
    for key in ("configured_s", "controller_overhead", "round_trip_overhead",
                "warmup_controller_overhead_ms", "step_p50_ms", "step_overhead_p50_ms"):
        print(f"{key}: {result[key]}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
