"""The GPU benchmark's pure parts: model sizes, vLLM log lines, statistics, the report."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from e2e.bench.stats import summary_s
from e2e.gpu import report
from e2e.gpu.shapes import weight_bytes, weight_tensors
from e2e.gpu.vllm_log import LogCursor, parse, summarise_start
from tests.gpu.models import CONFIGS

# -- model sizes ------------------------------------------------------------------------


def test_weight_bytes_match_the_published_parameter_counts() -> None:
    # 13.25 B and 0.51 B parameters in bfloat16 (the tools' measurements: 26.5 GB, 0.95 GiB)
    assert weight_bytes(CONFIGS["model-14b"]) == 26_508_851_200
    assert weight_bytes(CONFIGS["model-small"]) == 1_015_171_072


def test_tensors_are_fused_as_vllm_holds_them() -> None:
    names = [name for name, _ in weight_tensors(CONFIGS["model-small"])]
    assert "layers.0.qkv_proj" in names
    assert "layers.0.gate_up_proj" in names
    assert "lm_head" not in names  # tied to the embedding
    assert "lm_head" in [n for n, _ in weight_tensors(CONFIGS["model-14b"])]


def test_a_config_without_sizes_is_refused() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        weight_tensors({"num_hidden_layers": 2})


# -- vLLM's log -------------------------------------------------------------------------

LOG = """\
\x1b[1;36m(EngineCore_DP0 pid=301)\x1b[0;0m INFO 12-01 09:03:00 [gpu_model_runner.py:2000] \
Model loading took 24.6883 GiB memory and 3.514 seconds
(EngineCore_DP0 pid=301) INFO 12-01 09:03:40 [core.py:99] init engine (profile, create kv \
cache, warmup model) took 36.31 seconds
(EngineCore_DP0 pid=301) INFO 12-01 09:03:40 [kv_cache_utils.py:1] GPU KV cache size: \
1,048,576 tokens
(EngineCore_DP0 pid=301) INFO 12-01 09:05:00 [gpu_worker.py:1] Sleep mode freed 34.03 GiB \
memory, 0.77 GiB memory is still in use.
(EngineCore_DP0 pid=301) INFO 12-01 09:05:00 [abstract.py:312] It took 24.700012 seconds to \
fall asleep.
(EngineCore_DP0 pid=301) INFO 12-01 09:05:10 [abstract.py:330] It took 0.579123 seconds to \
wake up tags {'weights', 'kv_cache'}.
INFO:     127.0.0.1:40000 - "POST /wake_up HTTP/1.1" 200 OK
ValueError: Pointer argument (at 0) cannot be accessed from Triton (cpu tensor?)
vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.
"""


def test_the_log_lines_rota_reads() -> None:
    events = parse(LOG)
    kinds = [e.kind for e in events]
    assert kinds == ["model_loading", "init_engine", "kv_cache_tokens", "sleep_freed", "sleep",
                     "wake", "exception", "engine_dead"]
    by_kind = {e.kind: e.values for e in events}
    assert by_kind["wake"] == {"seconds": 0.579123}
    assert by_kind["sleep"] == {"seconds": 24.700012}
    assert by_kind["sleep_freed"] == {"freed_gib": 34.03, "in_use_gib": 0.77}
    assert summarise_start(events) == {"model_loading_gib": 24.6883,
                                       "model_loading_seconds": 3.514,
                                       "init_engine_seconds": 36.31,
                                       "kv_cache_tokens_tokens": 1048576.0}


def test_the_cursor_reads_only_what_was_added(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    path.write_text("It took 1.5 seconds to fall asleep.\n")
    cursor = LogCursor(path)
    assert [e.values for e in cursor.events()] == [{"seconds": 1.5}]
    assert cursor.events() == []
    with path.open("a") as out:
        out.write("It took 0.25 seconds to wake up tags ['weights'].\n")
    assert [e.kind for e in cursor.events()] == ["wake"]
    path.write_text("It took 2 seconds to fall asleep.\n")  # replaced by a shorter file
    assert [e.values for e in cursor.events()] == [{"seconds": 2.0}]


def test_a_missing_log_reads_as_empty(tmp_path: Path) -> None:
    assert LogCursor(tmp_path / "nothing.log").events() == []


# -- statistics -------------------------------------------------------------------------


def test_summary_of_durations() -> None:
    assert summary_s([]) == {"n": 0, "p50": None, "p90": None, "min": None, "max": None}
    values = [float(v) for v in range(1, 20)]  # 19 handoffs
    assert summary_s(values) == {"n": 19, "p50": 10.0, "p90": 17.0, "min": 1.0, "max": 19.0}
    assert summary_s([1.0, 2.0])["p50"] == 1.5


# -- handoff statistics and the report -------------------------------------------------------


def _handoff(index: int, ok: bool = True, **values: float) -> dict[str, Any]:
    source, target = ("a", "b") if index % 2 else ("b", "a")
    entry: dict[str, Any] = {"label": f"handoff {index}", "index": index, "from": source,
                             "to": target, "ok": ok, "reason": None if ok else "gpu_oom",
                             "message": None if ok else "no room"}
    return entry | values


def test_handoff_summary_by_direction_and_the_first_user_visible_handoff() -> None:
    entries = [_handoff(i, handoff_to_first_token_s=1.0 + (0.5 if i == 1 else 0.0) + i / 100,
                        recovery_to_first_token_s=0.5, wake_call_s=0.4, probe_ttft_s=0.1,
                        sleep_call_s=0.5, controller_overhead_s=0.01 * i)
               for i in range(1, 8)]
    entries.append(_handoff(8, ok=False))
    summary = report.handoff_summary(entries)
    assert summary["handoffs"] == 8
    assert summary["ok"] == 7
    assert summary["failed"] == [{"label": "handoff 8", "reason": "gpu_oom",
                                  "message": "no room"}]
    assert set(summary["by_direction"]) == {"a_to_b", "b_to_a"}
    assert summary["by_direction"]["a_to_b"]["wake_call"]["n"] == 4
    assert summary["all"]["controller_overhead"]["p50"] == pytest.approx(0.04)
    first = summary["first_user_visible"]
    assert first["direction"] == "a_to_b"
    assert first["handoff_to_first_token_s"] == pytest.approx(1.51)
    assert first["later_same_direction_p50_s"] == pytest.approx(1.05)  # handoffs 3, 5, 7
    assert first["ratio"] == pytest.approx(1.438, abs=1e-3)


def test_an_empty_run_still_summarises() -> None:
    summary = report.handoff_summary([])
    assert summary["ok"] == 0
    assert "first_user_visible" not in summary


def test_wake_decomposition() -> None:
    cycles = [
        {"mode": "sequential", "wake_post_ms": 600.0, "vllm_wake_s": 0.55, "confirm_ms": 2.0,
         "probe_ttft_ms": 70.0, "recovery_ms": 675.0},
        {"mode": "overlapped", "wake_post_ms": 590.0, "vllm_wake_s": 0.54, "confirm_ms": 2.5,
         "probe_ttft_ms": 70.0, "recovery_ms": 661.0},
        {"mode": "split", "wake_post_ms": 610.0, "vllm_wake_s": 0.56, "confirm_ms": 2.0,
         "probe_ttft_ms": 70.0, "recovery_ms": 690.0, "wake_weights": {"ms": 500.0},
         "wake_kv_cache": {"ms": 110.0}},
    ]
    h2d = {"bytes_per_s": 50e9, "detail": {"models": {"model-14b": {
        "sync_best_s": 0.5, "alloc_weights_s": 0.02, "alloc_kv_s": 0.01}}}}
    found = report.wake_decomposition(cycles, h2d, model="model-14b", weights_bytes=25 * 10**9)
    assert found["copy_floor_s"] == 0.5
    assert found["wake_post_p50_s"] == pytest.approx(0.595)
    assert found["vllm_executor_p50_s"] == pytest.approx(0.545)
    assert found["http_and_engine_core_s"] == pytest.approx(0.05)
    assert found["executor_beyond_chunked_copy_s"] == pytest.approx(0.045)
    assert found["fresh_allocations_s"] == pytest.approx(0.03)
    assert found["overlap_saves_s"] == pytest.approx(0.014)
    assert found["ratios_to_floor"]["wake_post"] == pytest.approx(1.19)
    assert found["by_mode"]["split"]["kv_cache_post_s"]["p50"] == pytest.approx(0.11)


def test_level2_summary_reads_the_recorded_steps() -> None:
    steps = {"wake_up_weights": 27.0, "reload_weights": 745.0, "wake_up_kv_cache": 17.0,
             "reset_prefix_cache": 3.0}
    wakes = [{"ok": True, "wake_call_s": 0.8, "recovery_to_first_token_s": 0.9,
              "handoff_to_first_token_s": 1.0,
              "calls": [{"call": "wake_l2", "ok": True, "steps_ms": steps}]}]
    found = report.level2_summary(wakes)
    assert found["steps"]["reload_weights"]["p50"] == pytest.approx(0.745)
    assert found["wake_call"]["n"] == 1


def test_markdown_carries_the_tables() -> None:
    entries = [_handoff(i, handoff_to_first_token_s=0.7, recovery_to_first_token_s=0.6,
                        wake_call_s=0.5, probe_ttft_s=0.1, sleep_call_s=0.5,
                        wake_over_floor=1.2, controller_overhead_s=0.012) for i in range(1, 5)]
    summary = {"device": "NVIDIA H200", "launcher": "vllm", "stage": "bench",
               "engines": {"a": {"model": "model-14b", "enforce_eager": True,
                                 "kv_cache_mib": 8192.0, "cold_start_s": 95.0,
                                 "first_sleep_s": 24.7, "first_wake_s": 0.6,
                                 "awake_mib": 35666.0, "asleep_mib": 786.0}},
               "scenarios": {"main": {"summary": report.handoff_summary(entries),
                                      "throughput": {"before": {
                                          "concurrency": 8, "rounds": 2, "max_tokens": 128,
                                          "tokens_per_s": 203.0},
                                          "after": {"tokens_per_s": 326.0}}},
                             "level2": {"ok": True, "wall_s": 12.0,
                                        "invariant_violations": 0}},
               "sampler": {"samples": 1000, "interval_ms": {"p50": 5.0, "p99": 6.0},
                           "violations": 0}}
    text = report.markdown(summary)
    assert "| a_to_b | 0.700 / 0.700 | 0.600 / 0.600 | 0.500 | 1.20 |" in text
    assert "12.0 |" in text  # controller overhead in ms
    assert "203.0 tok/s before, 326.0 after" in text
    assert "**level2**: ok in 12.0 s; NVML invariant violations 0" in text


def test_several_files_read_as_one_run() -> None:
    first = {"stage": "bench", "scenarios": {"startup": {"ok": True}, "main": {"ok": False}},
             "sampler": {"samples": 10, "violations": 0, "interval_ms": {"p50": 5.0,
                                                                          "p99": 6.0}},
             "engines": {"a": {"dead": False}}}
    second = {"stage": "more", "scenarios": {"main": {"ok": True}, "wake_oom": {"ok": True}},
              "sampler": {"samples": 5, "violations": 1, "interval_ms": {"p50": 5.5,
                                                                          "p99": 9.0}},
              "engines": {"a": {"dead": True}}}
    merged = report.merge([first, second])
    assert merged["stage"] == "bench+more"
    assert merged["scenarios"] == {"startup": {"ok": True}, "main": {"ok": True},
                                   "wake_oom": {"ok": True}}
    assert merged["sampler"] == {"samples": 15, "violations": 1,
                                 "interval_ms": {"p50": 5.5, "p99": 9.0}}
    assert merged["engines"] == {"a": {"dead": True}}


def test_the_reference_experiment_beside_the_run() -> None:
    entries = [_handoff(i, recovery_to_first_token_s=0.6 if i % 2 == 0 else 0.1,
                        sleep_call_s=0.5 if i % 2 else 0.04) for i in range(1, 20)]
    summary = {"device": "NVIDIA H200", "launcher": "vllm",
               "engines": {"a": {"model": "model-14b", "first_sleep_s": 24.7,
                                 "awake_mib": 35666.0, "asleep_mib": 786.0},
                           "b": {"model": "model-small", "first_sleep_s": 0.9,
                                 "awake_mib": 6224.0, "asleep_mib": 782.0}},
               "scenarios": {"main": {"summary": report.handoff_summary(entries),
                                      "throughput": {"before": {"tokens_per_s": 203.0,
                                                                "concurrency": 8},
                                                     "after": {"tokens_per_s": 326.0}}}}}
    table = report.reference_table(summary)
    assert "| level-1 handoffs | 19 of 19 | 19 of 19 |" in table
    assert "| recovery to first token of A, p50 s | 1.86 | 0.600 |" in table
    assert "| later sleeps of A, p50 s | 1.33-1.34 | 0.500 |" in table
    assert "A 34.83, B 6.08 (per process)" in table
    assert "203.0 / 326.0 tok/s (concurrency 8)" in table
