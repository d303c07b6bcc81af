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
