"""The few statistics the benchmarks report."""

from __future__ import annotations

import statistics
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of a non-empty sequence."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    """Count, median, p99 and maximum of durations given in seconds, in milliseconds."""
    ms = [v * 1e3 for v in values_s]
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2),
            "p99_ms": round(percentile(ms, 0.99), 2), "max_ms": round(max(ms), 2)}


def summary_s(values_s: Sequence[float], digits: int = 4) -> dict[str, float | int | None]:
    """Count, median, p90 (nearest rank), minimum and maximum of durations in seconds;
    nulls when there are none (a scenario that produced no sample still reports)."""
    if not values_s:
        return {"n": 0, "p50": None, "p90": None, "min": None, "max": None}
    return {"n": len(values_s), "p50": round(statistics.median(values_s), digits),
            "p90": round(percentile(values_s, 0.9), digits),
            "min": round(min(values_s), digits), "max": round(max(values_s), digits)}
