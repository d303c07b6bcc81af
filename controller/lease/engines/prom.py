"""Just enough of the Prometheus text format to read an engine's in-flight and sleep gauges.

Drain waits until an engine has no requests running or waiting. vLLM says so on its own
``/metrics`` page (``vllm:num_requests_running``, ``vllm:num_requests_waiting``), one
sample per label set (``model_name``, ``engine`` for each data-parallel engine core), so
the adapter sums every sample of those names. ``vllm:engine_sleep_state`` has one sample
per ``sleep_state`` label value (``awake``, ``weights_offloaded``, ``discard_all``), 1 for
the state vLLM last recorded: :func:`label_values_at_one` reads it. Pure: text in,
numbers out. A line is parsed only when it begins with a wanted name: vLLM's page holds
hundreds of histogram buckets, and a sleep's or a wake's confirmation reads it on the
switch's critical path.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

__all__ = ["label_values_at_one", "sum_samples"]


def _labels(text: str) -> dict[str, str]:
    """The label set inside ``{...}`` (without the braces); malformed parts are skipped."""
    labels: dict[str, str] = {}
    i = 0
    while i < len(text):
        eq = text.find("=", i)
        if eq == -1 or eq + 1 >= len(text) or text[eq + 1] != '"':
            break
        name = text[i:eq].strip().lstrip(",").strip()
        j, value = eq + 2, []
        while j < len(text) and text[j] != '"':
            if text[j] == "\\" and j + 1 < len(text):
                value.append({"n": "\n"}.get(text[j + 1], text[j + 1]))
                j += 2
                continue
            value.append(text[j])
            j += 1
        labels[name] = "".join(value)
        i = j + 1
    return labels


def _split_labelled(line: str) -> tuple[str, dict[str, str], str] | None:
    """``(name, labels, value text)`` of one sample line, or None if it is not one."""
    sample = _split_sample(line)
    if sample is None:
        return None
    name, value = sample
    brace = line.find("{")
    labels: dict[str, str] = {}
    if brace != -1 and brace == len(name):
        end = line.rfind("}")
        labels = _labels(line[brace + 1:end]) if end > brace else {}
    return name, labels, value


def label_values_at_one(text: str, name: str, label: str) -> set[str] | None:
    """The values of ``label`` over the samples of ``name`` whose value is 1.

    None when the page has no sample of ``name`` at all (the engine does not export it).
    """
    found = False
    values: set[str] = set()
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(name):
            continue
        sample = _split_labelled(line)
        if sample is None or sample[0] != name:
            continue
        found = True
        try:
            value = float(sample[2])
        except ValueError:
            continue
        if value == 1.0 and label in sample[1]:
            values.add(sample[1][label])
    return values if found else None


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
    prefixes = tuple(wanted)
    total = 0.0
    found = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line.startswith(prefixes):
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
