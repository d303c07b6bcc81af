"""Statistics and tables of the GPU benchmark's results (pure: dicts in, dicts and text out).

    python -m e2e.gpu.report bench.json [bench2.json more.json ...]   # markdown tables
    python -m e2e.gpu.report policy.json [policy-simulator.json ...]  # the policy comparison

Several files of one machine are read as one run (a later run of a scenario wins). Files
of ``python -m e2e.gpu.policy_run`` are printed one by one (the summary per window and
policy: SLO goodput, frozen requests and their verdicts), followed, for two or more, by
each window's ranking of the policies in each file and whether the rankings agree (the
simulator's run, ``--launcher simulator``, beside the real engines').

The handoff blocks follow the reference experiment's three timing boundaries (DESIGN.md):
the wake call, recovery to first token (wake call + the probe's time to first token) and
handoff to first token (from starting to put the holder to sleep until the target's first
token). Controller overhead is handoff minus sleep call, wake call and probe TTFT: what
rota itself adds (the sleep's confirmation and the NVML check, which run at once; the
fencing reads; Python). The wake's confirmation runs beside the probe.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from e2e.bench.stats import summary_s
from e2e.gpu.policy_slo import Bounds, rankings_agree, share

__all__ = ["handoff_line", "handoff_summary", "level2_summary", "markdown", "policy_rankings",
           "policy_summary", "policy_totals", "scenario_verdict", "text", "wake_cycle_line",
           "wake_decomposition"]

TIMINGS = ("handoff_to_first_token_s", "recovery_to_first_token_s", "wake_call_s",
           "probe_ttft_s", "sleep_call_s", "controller_overhead_s", "sleep_confirm_s",
           "wake_confirm_s", "inspect_s", "vllm_wake_s", "vllm_sleep_s", "wake_over_floor")


def _values(entries: Iterable[Mapping[str, Any]], key: str) -> list[float]:
    return [float(e[key]) for e in entries if e.get(key) is not None]


def _block(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    return {key.removesuffix("_s"): summary_s(_values(entries, key)) for key in TIMINGS}


def handoff_summary(entries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """p50/p90 of every timing, overall and by direction, of the handoffs that succeeded;
    the first handoff (the first a user sees) beside the later ones of its direction."""
    ok = [e for e in entries if e.get("ok")]
    directions: dict[str, list[Mapping[str, Any]]] = {}
    for entry in ok:
        directions.setdefault(f"{entry['from']}_to_{entry['to']}", []).append(entry)
    result: dict[str, Any] = {"handoffs": len(entries), "ok": len(ok),
                              "failed": [{"label": e.get("label"), "reason": e.get("reason"),
                                          "message": e.get("message")}
                                         for e in entries if not e.get("ok")],
                              "all": _block(ok),
                              "by_direction": {k: _block(v) for k, v in directions.items()}}
    if ok:
        first = ok[0]
        later = [e for e in ok[1:] if (e["from"], e["to"]) == (first["from"], first["to"])]
        later_p50 = summary_s(_values(later, "handoff_to_first_token_s"))["p50"]
        first_value = first.get("handoff_to_first_token_s")
        result["first_user_visible"] = {
            "direction": f"{first['from']}_to_{first['to']}",
            "handoff_to_first_token_s": first_value,
            "later_same_direction_p50_s": later_p50,
            "ratio": (round(first_value / later_p50, 3)
                      if first_value is not None and later_p50 else None)}
    return result


def level2_summary(wakes: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The level-2 wake call and each of its steps, from the adapter's recorded calls."""
    steps: dict[str, list[float]] = {}
    for entry in wakes:
        for call in entry.get("calls", []):
            if str(call.get("call", "")).startswith("wake_l2") and call.get("ok"):
                for name, ms in (call.get("steps_ms") or {}).items():
                    steps.setdefault(name, []).append(ms / 1e3)
    return {"wake_call": summary_s(_values(wakes, "wake_call_s")),
            "recovery_to_first_token": summary_s(_values(wakes, "recovery_to_first_token_s")),
            "handoff_to_first_token": summary_s(_values(wakes, "handoff_to_first_token_s")),
            "steps": {name: summary_s(values) for name, values in steps.items()}}


def wake_decomposition(cycles: Sequence[Mapping[str, Any]], h2d: Mapping[str, Any], *,
                       model: str, weights_bytes: int) -> dict[str, Any]:
    """Where a level-1 wake's time goes: the copy floor (bulk and tensor by tensor), fresh
    device allocations, vLLM's executor time, the HTTP and engine-core round trip, and the
    confirmation; with what overlapping the confirmation with the probe saves."""
    bandwidth = float(h2d.get("bytes_per_s") or 54e9)
    detail = (h2d.get("detail") or {}).get("models", {}).get(model, {})
    floor = weights_bytes / bandwidth
    by_mode: dict[str, dict[str, Any]] = {}
    for mode in ("sequential", "overlapped", "split"):
        rows = [c for c in cycles if c.get("mode") == mode]
        by_mode[mode] = {
            "cycles": len(rows),
            "wake_post_s": summary_s([r["wake_post_ms"] / 1e3 for r in rows
                                      if r.get("wake_post_ms") is not None]),
            "vllm_wake_s": summary_s(_values(rows, "vllm_wake_s")),
            "confirm_s": summary_s([r["confirm_ms"] / 1e3 for r in rows
                                    if r.get("confirm_ms") is not None]),
            "probe_ttft_s": summary_s([r["probe_ttft_ms"] / 1e3 for r in rows
                                       if r.get("probe_ttft_ms") is not None]),
            "warm_probe_ttft_s": summary_s([r["warm_probe_ttft_ms"] / 1e3 for r in rows
                                            if r.get("warm_probe_ttft_ms") is not None]),
            "recovery_s": summary_s([r["recovery_ms"] / 1e3 for r in rows
                                     if r.get("recovery_ms") is not None])}
    split = [c for c in cycles if c.get("mode") == "split"]
    by_mode["split"]["weights_post_s"] = summary_s(
        [c["wake_weights"]["ms"] / 1e3 for c in split if c.get("wake_weights")])
    by_mode["split"]["kv_cache_post_s"] = summary_s(
        [c["wake_kv_cache"]["ms"] / 1e3 for c in split if c.get("wake_kv_cache")])
    whole = [c for c in cycles if c.get("mode") != "split"]
    post = summary_s([c["wake_post_ms"] / 1e3 for c in whole])["p50"]
    internal = summary_s(_values(whole, "vllm_wake_s"))["p50"]
    chunked = detail.get("sync_best_s")
    alloc = None
    if detail.get("alloc_weights_s") is not None and detail.get("alloc_kv_s") is not None:
        alloc = detail["alloc_weights_s"] + detail["alloc_kv_s"]
    seq = by_mode["sequential"]["recovery_s"]["p50"]
    over = by_mode["overlapped"]["recovery_s"]["p50"]

    def share(value: float | None) -> float | None:
        return None if value is None else round(value / floor, 3)

    bulk = (h2d.get("detail") or {}).get("bulk") or {}
    pin_rate = (bulk.get("pin") or {}).get("bytes_per_s")
    pageable = bulk.get("pageable_best_bytes_per_s")
    return {
        "weights_bytes": weights_bytes, "bandwidth_bytes_per_s": bandwidth,
        "pageable_copy_s": round(weights_bytes / pageable, 4) if pageable else None,
        "first_sleep_pinning_estimate_s": (round(weights_bytes / pin_rate, 2)
                                           if pin_rate else None),
        "copy_floor_s": round(floor, 4),
        "chunked_copy_s": chunked, "fresh_allocations_s": alloc,
        "wake_post_p50_s": post, "vllm_executor_p50_s": internal,
        "http_and_engine_core_s": (round(post - internal, 4)
                                   if post is not None and internal is not None else None),
        "executor_beyond_chunked_copy_s": (round(internal - chunked, 4)
                                           if internal is not None and chunked else None),
        "ratios_to_floor": {"wake_post": share(post), "vllm_executor": share(internal),
                            "chunked_copy": share(chunked)},
        "by_mode": by_mode,
        "overlap_saves_s": (round(seq - over, 4) if seq is not None and over is not None
                            else None),
    }


def _s(value: Any, digits: int = 3) -> str:
    return "-" if value is None else f"{float(value):.{digits}f}"


def handoff_line(entry: Mapping[str, Any]) -> str:
    head = f"{entry.get('label')}: {entry.get('from') or '-'} -> {entry.get('to')}"
    if not entry.get("ok"):
        return f"{head} FAILED {entry.get('reason')}: {entry.get('message')}"
    return (f"{head}: handoff {_s(entry.get('handoff_to_first_token_s'))} s, wake "
            f"{_s(entry.get('wake_call_s'))} s (vLLM {_s(entry.get('vllm_wake_s'))}, "
            f"x{_s(entry.get('wake_over_floor'), 2)} floor), recovery "
            f"{_s(entry.get('recovery_to_first_token_s'))} s, sleep "
            f"{_s(entry.get('sleep_call_s'))} s, overhead "
            f"{_s((entry.get('controller_overhead_s') or 0) * 1e3, 1)} ms")


def wake_cycle_line(cycle: Mapping[str, Any]) -> str:
    return (f"wake cycle ({cycle.get('mode')}): wake POST {_s(cycle.get('wake_post_ms'), 1)} ms "
            f"(vLLM {_s((cycle.get('vllm_wake_s') or 0) * 1e3, 1)} ms), confirm "
            f"{_s(cycle.get('confirm_ms'), 1)} ms, probe TTFT "
            f"{_s(cycle.get('probe_ttft_ms'), 1)} ms, recovery "
            f"{_s(cycle.get('recovery_ms'), 1)} ms")


def scenario_verdict(name: str, result: Mapping[str, Any]) -> str:
    if result.get("skipped"):
        return f"skipped: {result.get('reason')}"
    if result.get("error"):
        return f"ERROR {result['error']}"
    verdict = "ok" if result.get("ok") else "NOT OK"
    return (f"{verdict} in {_s(result.get('wall_s'), 1)} s; NVML invariant violations "
            f"{result.get('invariant_violations')}")


def _row(cells: Iterable[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _p(block: Mapping[str, Any] | None, key: str = "p50", scale: float = 1.0,
       digits: int = 3) -> str:
    if not block or block.get(key) is None:
        return "-"
    return f"{block[key] * scale:.{digits}f}"


def markdown(summary: Mapping[str, Any]) -> str:
    """The tables of one result file, for README.md and the issue's closing note."""
    out: list[str] = [f"### rota on {summary.get('device')} ({summary.get('launcher')}, "
                      f"stage {summary.get('stage')})", ""]
    engines = summary.get("engines") or {}
    if engines:
        out += [_row(["engine", "model", "KV cache MiB", "cold start s", "first sleep s",
                      "first wake s", "awake MiB", "asleep MiB"]),
                _row(["---"] * 8)]
        for key, e in engines.items():
            out.append(_row([key, f"{e['model']}{'' if e['enforce_eager'] else ' (graphs)'}",
                             e["kv_cache_mib"], _s(e["cold_start_s"], 1),
                             _s(e["first_sleep_s"]), _s(e["first_wake_s"]), e["awake_mib"],
                             e["asleep_mib"]]))
        out.append("")
    scenarios = summary.get("scenarios") or {}
    main = scenarios.get("main") or {}
    if main.get("summary"):
        s = main["summary"]
        out += [f"19-handoff protocol: {s['ok']} of {s['handoffs']} succeeded.", "",
                _row(["direction", "handoff to first token p50/p90 s", "recovery p50/p90 s",
                      "wake call p50 s", "x floor p50", "vLLM wake p50 s",
                      "probe TTFT p50 s", "controller overhead p50 ms"]),
                _row(["---"] * 8)]
        for direction, b in s["by_direction"].items():
            out.append(_row([direction, f"{_p(b['handoff_to_first_token'])} / "
                             f"{_p(b['handoff_to_first_token'], 'p90')}",
                             f"{_p(b['recovery_to_first_token'])} / "
                             f"{_p(b['recovery_to_first_token'], 'p90')}",
                             _p(b["wake_call"]), _p(b["wake_over_floor"], digits=2),
                             _p(b["vllm_wake"]), _p(b["probe_ttft"]),
                             _p(b["controller_overhead"], scale=1e3, digits=1)]))
        overall = s["all"]
        out += ["", "Controller overhead p50 "
                    f"{_p(overall['controller_overhead'], scale=1e3, digits=1)} ms; its parts "
                    f"(p50): sleep confirmation {_p(overall['sleep_confirm'], scale=1e3, digits=1)}"
                    f" ms beside the NVML check {_p(overall['inspect'], scale=1e3, digits=1)} "
                    "ms (run at once), wake confirmation "
                    f"{_p(overall['wake_confirm'], scale=1e3, digits=1)} ms beside the probe."]
        first = s.get("first_user_visible") or {}
        out += ["", f"First user-visible handoff ({first.get('direction')}): "
                    f"{_s(first.get('handoff_to_first_token_s'))} s; later ones of that "
                    f"direction p50 {_s(first.get('later_same_direction_p50_s'))} s "
                    f"(ratio {_s(first.get('ratio'), 2)})."]
        startup = scenarios.get("startup") or {}
        if startup.get("first_sleeps_s"):
            out.append("First sleeps, done by start-up admission before any traffic: " + ", ".join(
                f"{k.upper()} {_s(v)} s" for k, v in startup["first_sleeps_s"].items()) + ".")
        tp = main.get("throughput") or {}
        if tp.get("before"):
            out.append(f"Throughput of A ({tp['before']['concurrency']} x "
                       f"{tp['before']['rounds']} x {tp['before']['max_tokens']} forced "
                       f"tokens): {tp['before']['tokens_per_s']} tok/s before, "
                       f"{(tp.get('after') or {}).get('tokens_per_s')} after a recovery.")
        out.append("")
    detail = (scenarios.get("wake_detail") or {}).get("decomposition")
    if detail:
        out += ["Level-1 wake of A taken apart (p50):", "",
                _row(["copy floor s", "tensor-by-tensor copy s", "fresh allocations s",
                      "vLLM executor s", "HTTP + engine core s", "wake POST s",
                      "confirmation overlapped with probe saves s", "TTFT after wake / warm s"]),
                _row(["---"] * 8),
                _row([_s(detail["copy_floor_s"]), _s(detail["chunked_copy_s"]),
                      _s(detail["fresh_allocations_s"]), _s(detail["vllm_executor_p50_s"]),
                      _s(detail["http_and_engine_core_s"]), _s(detail["wake_post_p50_s"]),
                      _s(detail["overlap_saves_s"], 4),
                      f"{_p(detail['by_mode']['sequential']['probe_ttft_s'])} / "
                      f"{_p(detail['by_mode']['sequential']['warm_probe_ttft_s'])}"]), ""]
    for name, result in scenarios.items():
        if name in ("main", "wake_detail"):
            continue
        out.append(f"- **{name}**: {scenario_verdict(name, result)}")
    out.append("")
    sampler = summary.get("sampler") or {}
    if sampler:
        out.append(f"NVML sampled {sampler.get('samples')} times (interval p50 "
                   f"{sampler.get('interval_ms', {}).get('p50')} ms, p99 "
                   f"{sampler.get('interval_ms', {}).get('p99')} ms); samples with more "
                   f"engines above resident than allowed: {sampler.get('violations')}.")
    return "\n".join(out)


REFERENCE = {
    "setup": "NVIDIA L20 48 GB, vLLM sleep mode, A = 27B FP8, B = 1.7B BF16",
    "handoffs": "19 of 19",
    "recovery_a_s": 1.86,
    "first_sleep_a_s": 18.47,
    "later_sleep_a_s": "1.33-1.34",
    "first_sleep_b_s": 2.07,
    "later_sleep_b_s": "0.17-0.19",
    "awake_gib": "A 33.05, B 8.31",
    "asleep_gib": 1.03,
    "throughput": "92.64 / 92.68 tok/s (concurrency 4)",
}
"""The published reference experiment (DESIGN.md), beside which the tables are read."""


def merge(summaries: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several result files of one machine as one: scenarios of all (a later run of a
    scenario wins), engines as the last file knows them, NVML samples and violations
    summed."""
    if not summaries:
        return {}
    merged: dict[str, Any] = dict(summaries[-1])
    merged["stage"] = "+".join(str(s.get("stage")) for s in summaries)
    merged["scenarios"] = {}
    for summary in summaries:
        merged["scenarios"].update(summary.get("scenarios") or {})
    samplers = [s.get("sampler") or {} for s in summaries]
    merged["sampler"] = {
        "samples": sum(x.get("samples") or 0 for x in samplers),
        "violations": sum(x.get("violations") or 0 for x in samplers),
        "interval_ms": {"p50": max((x.get("interval_ms") or {}).get("p50") or 0
                                   for x in samplers),
                        "p99": max((x.get("interval_ms") or {}).get("p99") or 0
                                   for x in samplers)}}
    return merged


def reference_table(summary: Mapping[str, Any]) -> str:
    """This run beside the reference experiment, row for row."""
    engines = summary.get("engines") or {}
    scenarios = summary.get("scenarios") or {}
    main = (scenarios.get("main") or {}).get("summary") or {}
    by = main.get("by_direction") or {}
    to_a = by.get("b_to_a") or {}
    from_a = by.get("a_to_b") or {}
    a, b = engines.get("a") or {}, engines.get("b") or {}
    tp = (scenarios.get("main") or {}).get("throughput") or {}

    def gib(mib_value: Any) -> str:
        return "-" if mib_value is None else f"{float(mib_value) / 1024:.2f}"

    rows = [
        ("setup", REFERENCE["setup"],
         f"{summary.get('device')}, "
         f"{'vLLM' if summary.get('launcher') == 'vllm' else 'engine simulator'}, A = "
         f"{a.get('model')} bf16, B = {b.get('model')} bf16"),
        ("level-1 handoffs", REFERENCE["handoffs"], f"{main.get('ok')} of {main.get('handoffs')}"),
        ("recovery to first token of A, p50 s", REFERENCE["recovery_a_s"],
         _p(to_a.get("recovery_to_first_token"))),
        ("first level-1 sleep of A s", REFERENCE["first_sleep_a_s"],
         f"{_s(a.get('first_sleep_s'))} (at start-up, before any traffic)"),
        ("later sleeps of A, p50 s", REFERENCE["later_sleep_a_s"], _p(from_a.get("sleep_call"))),
        ("first level-1 sleep of B s", REFERENCE["first_sleep_b_s"],
         f"{_s(b.get('first_sleep_s'))} (at start-up)"),
        ("later sleeps of B, p50 s", REFERENCE["later_sleep_b_s"], _p(to_a.get("sleep_call"))),
        ("GPU memory awake GiB", REFERENCE["awake_gib"],
         f"A {gib(a.get('awake_mib'))}, B {gib(b.get('awake_mib'))} (per process)"),
        ("asleep GiB", REFERENCE["asleep_gib"],
         f"A {gib(a.get('asleep_mib'))}, B {gib(b.get('asleep_mib'))} (per process)"),
        ("throughput before / after a recovery", REFERENCE["throughput"],
         f"{(tp.get('before') or {}).get('tokens_per_s')} / "
         f"{(tp.get('after') or {}).get('tokens_per_s')} tok/s (concurrency "
         f"{(tp.get('before') or {}).get('concurrency')})"),
    ]
    lines = [_row(["", "reference experiment", "this run"]), _row(["---"] * 3)]
    lines += [_row(row) for row in rows]
    return "\n".join(lines)


def text(summary: Mapping[str, Any]) -> str:
    """What a run prints at its end (the markdown, plus the error if any)."""
    lines = [markdown(summary)]
    if summary.get("error"):
        lines.append(f"run error: {summary['error']}")
    return "\n".join(lines)


# -- the policy comparison (python -m e2e.gpu.policy_run) ----------------------------------

POLICY_COUNTS = ("requests", "served", "goodput", "slo_goodput", "wakes", "wasted",
                 "sent_back", "frozen", "identical", "altered", "lost", "unchecked")


def _pct(value: float) -> str:
    return "-" if value != value else f"{value:.1f}"  # NaN: nothing to share


def policy_totals(per_model: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """The counts of one policy's rows, summed over its models."""
    return {k: int(sum(r.get(k) or 0 for r in per_model)) for k in POLICY_COUNTS}


def _policy_line(label: str, mode: str, t: Mapping[str, int], never_frozen: Any) -> str:
    return _row([label, mode, t["requests"], t["goodput"], f"**{t['slo_goodput']}**",
                 _pct(share(t["slo_goodput"], t["requests"])), t["frozen"],
                 f"{t['identical']} / {t['altered']} / {t['lost']}", never_frozen, t["wakes"]])


def policy_summary(windows: Sequence[Mapping[str, Any]], bounds: Bounds) -> str:
    """One line per window and policy, then each policy over all windows: requests,
    goodput at the first-token objective, SLO goodput and its share, the frozen requests'
    verdicts, the never-frozen requests' altered count, wakes. All-awake where the engines
    do not fit together says so; a replay the budget left out says so."""
    head = ["window", "policy", "requests", f"TTFT ≤ {bounds.first_token_s:g} s",
            f"SLO met (gaps ≤ {bounds.longest_freeze_s:g} s)", "SLO %", "frozen",
            "identical / altered / lost", "altered of the never frozen", "wakes"]
    lines = [_row(head), _row(["---"] * len(head))]
    overall: dict[str, dict[str, int]] = {}
    for w in windows:
        label = f"{w['start_s']:g} s"
        for run in w.get("runs", []):
            if run.get("fits") is False:
                lines.append(_row([label, run["mode"], "", f"does not fit ({run['need_mib']} "
                                   f"of {run['gpu_mib']} MiB)"] + [""] * 6))
                continue
            if run.get("skipped"):
                lines.append(_row([label, run["mode"], "", f"skipped: {run['skipped']}"]
                                  + [""] * 6))
                continue
            t = policy_totals(run["rows"])
            never = (run.get("not_frozen") or {}).get("altered", 0)
            acc = overall.setdefault(run["mode"], dict.fromkeys((*t, "never_altered"), 0))
            for k, v in t.items():
                acc[k] += v
            acc["never_altered"] += never
            lines.append(_policy_line(label, run["mode"], t, never))
    for mode, t in overall.items():
        lines.append(_policy_line("**all**", f"**{mode}**", t, t["never_altered"]))
    return "\n".join(lines)


def _label(result: Mapping[str, Any]) -> str:
    return f"{result.get('launcher')} on {result.get('device')}"


def policy_rankings(results: Sequence[Mapping[str, Any]]) -> str:
    """Each window's policies from the highest SLO goodput down, per file, and whether
    every file orders the policies they share alike (the simulator's ranking holding on
    the real engines)."""
    starts = sorted({w["start_s"] for r in results for w in r.get("windows", [])})
    lines = [_row(["window", *(_label(r) for r in results), "rankings agree"]),
             _row(["---"] * (len(results) + 2))]
    for start in starts:
        goodputs = []
        for r in results:
            w = next((x for x in r.get("windows", []) if x["start_s"] == start), None)
            runs = (w or {}).get("runs", [])
            goodputs.append({x["mode"]: x["slo_goodput"] for x in runs if "slo_goodput" in x})
        agree = all(rankings_agree(goodputs[0], g) for g in goodputs[1:])
        cells = [" > ".join(f"{p} {g[p]}" for p in sorted(g, key=lambda p: (-g[p], p)))
                 for g in goodputs]
        lines.append(_row([f"{start:g} s", *cells, "yes" if agree else "**no**"]))
    return "\n".join(lines)


def policy_text(results: Sequence[Mapping[str, Any]]) -> str:
    """The summary of each policy comparison file, and their rankings side by side."""
    out: list[str] = []
    for result in results:
        bounds = Bounds(first_token_s=result.get("ttft_slo_s", 2.0),
                        longest_freeze_s=result.get("longest_freeze_s", 3.0))
        out += [f"### Policies on {_label(result)}: {result.get('engines_count')} engines, "
                f"{result.get('trace')}", "", policy_summary(result.get("windows", []), bounds),
                ""]
    if len(results) > 1:
        out += ["Rankings by SLO goodput:", "", policy_rankings(results), ""]
    return "\n".join(out)


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    loaded = [json.loads(Path(p).read_text(encoding="utf-8")) for p in paths]
    if all(r.get("benchmark") == "policy_on_engines" for r in loaded):
        print(policy_text(loaded))
        return 0
    summary = merge(loaded)
    print(markdown(summary))
    if (summary.get("scenarios") or {}).get("main"):
        print()
        print(reference_table(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
