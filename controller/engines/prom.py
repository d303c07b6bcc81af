"""Just enough of the Prometheus text format to read an engine's in-flight gauges.

Drain waits until an engine has no requests running or waiting. vLLM says so on its own
``/metrics`` page (``vllm:num_requests_running``, ``vllm:num_requests_waiting``), one
sample per label set (``model_name``, ``engine`` for each data-parallel engine core), so
the adapter sums every sample of those names. Pure: text in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["sum_samples"]


def _split_sample(line: str) -> tuple[str, str] | None:
    """``(metric name, value text)`` of one sample line, or None if it is not one."""
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace]
        i, quoted = brace + 1, False
        while i < len(line):  # find the closing brace outside quoted label values
            char = line[i]
            if quoted and char == "\\":
                i += 2
                continue
            if char == '"':
                quoted = not quoted
            elif char == "}" and not quoted:
                break
            i += 1
        else:
            return None
        rest = line[i + 1:]
    elif space != -1:
        name, rest = line[:space], line[space:]
    else:
        return None
    fields = rest.split()
    if not name or not fields:
        return None
    return name, fields[0]


def sum_samples(text: str, names: Iterable[str]) -> float | None:
    """The sum of every sample of the metrics named, over all label sets.

    None when no sample of any of them is present. Comments, other metrics, malformed
    lines and non-finite values are skipped.
    """
    wanted = frozenset(names)
    total = 0.0
    found = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        sample = _split_sample(line)
        if sample is None or sample[0] not in wanted:
            continue
        try:
            value = float(sample[1])
        except ValueError:
            continue
        if not math.isfinite(value):
            continue
        total += value
        found = True
    return total if found else None
