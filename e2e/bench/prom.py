"""Benchmark: reading an engine's gauges from a vLLM-sized ``/metrics`` page.

    python -m e2e.bench.prom [--repeats 200]

A drain and every sleep or wake confirmation read ``vllm:num_requests_*`` or
``vllm:engine_sleep_state`` from the engine's page, on the switch's critical path. The page
here has vLLM 0.26's shape (13 histograms of 23 buckets for one model and engine core, the
sleep-state and request gauges). Prints the milliseconds per read of each gauge; a JSON
object last.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

from controller.lease.engines import prom
from controller.lease.engines.common import IN_FLIGHT_METRICS, SLEEP_STATE_METRIC

HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_prompt_tokens", "request_generation_tokens",
              "inter_token_latency_seconds", "request_queue_time_seconds",
              "request_inference_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "iteration_tokens_total",
              "request_max_num_generation_tokens", "request_params_n",
              "request_params_max_tokens")
BUCKETS = ("0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5",
           "0.75", "1.0", "2.5", "5.0", "7.5", "10.0", "20.0", "40.0", "80.0", "160.0",
           "640.0", "2560.0", "+Inf")
LABELS = 'engine="0",model_name="org/model"'


def vllm_page() -> str:
    lines: list[str] = []
    for name in HISTOGRAMS:
        metric = f"vllm:{name}"
        lines += [f"# HELP {metric} {name}", f"# TYPE {metric} histogram"]
        lines += [f'{metric}_bucket{{{LABELS},le="{le}"}} {i}.0' for i, le in enumerate(BUCKETS)]
        lines += [f"{metric}_sum{{{LABELS}}} 12.5", f"{metric}_count{{{LABELS}}} 22.0"]
    lines += [f'{SLEEP_STATE_METRIC}{{{LABELS},sleep_state="{state}"}} {value}'
              for state, value in (("awake", "1.0"), ("weights_offloaded", "0.0"),
                                   ("discard_all", "0.0"))]
    lines += [f"{metric}{{{LABELS}}} 0.0" for metric in IN_FLIGHT_METRICS]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m e2e.bench.prom", description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    page = vllm_page()
    reads: dict[str, Callable[[], object]] = {
        "sleep_state": lambda: prom.label_values_at_one(page, SLEEP_STATE_METRIC,
                                                        "sleep_state"),
        "in_flight": lambda: prom.sum_samples(page, IN_FLIGHT_METRICS),
    }
    result: dict[str, object] = {"benchmark": "prom_gauges", "page_bytes": len(page)}
    for name, read in reads.items():
        began = time.perf_counter()
        for _ in range(args.repeats):
            read()
        ms = (time.perf_counter() - began) / args.repeats * 1e3
        print(f"{name}: {ms:.3f} ms per read of a {len(page)}-byte page")
        result[f"{name}_ms"] = round(ms, 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
