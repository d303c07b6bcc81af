"""What a campaign counts, and its report: pure bookkeeping, no I/O."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from rota.api.quantity import format_bytes

__all__ = ["AWAKE_SET", "ONE_AWAKE", "Answer", "Tally"]


class Answer:
    """How a client request ended (a label)."""

    OK = "ok"
    """200 and a complete answer (a stream ending in ``[DONE]``)."""
    REFUSED = "refused"
    """An explicit 429/503 with ``Retry-After``: an answer, by the campaign's rule."""
    UNANSWERED = "unanswered"
    """Anything else: a connection error, a timeout, a 5xx without Retry-After, a stream
    cut short. The campaign's target is zero of these."""


ONE_AWAKE, AWAKE_SET = "one-awake", "awake-set"
"""The campaign's modes (:attr:`e2e.chaos.rig.RigOptions.mode`)."""


@dataclass
class Tally:
    mode: str = ONE_AWAKE
    """What the GPUs were sampled for: two engines awake (one-awake), or the memory in use
    over the GPU's total and more engines awake than their budgets fit (awake-set)."""
    switches: int = 0
    failed_switches: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    answers: Counter[str] = field(default_factory=Counter)
    unanswered_samples: list[str] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)
    """Refused requests by status and error type (``503 switch_failed``...)."""
    faults: Counter[str] = field(default_factory=Counter)
    """Faults that took effect, by name."""
    faults_missed: Counter[str] = field(default_factory=Counter)
    """Faults tried that did not take effect (nothing to inject into then)."""
    double_awake: int = 0
    """Samples in which two engines of one GPU held more than their resident memory."""
    double_awake_samples: list[str] = field(default_factory=list)
    over_gpu: int = 0
    """Awake-set mode: samples in which a GPU's memory in use exceeded its total."""
    over_gpu_samples: list[str] = field(default_factory=list)
    crowded: int = 0
    """Awake-set mode: samples in which more engines of a GPU held more than their
    resident memory than their awake budgets let be awake together."""
    crowded_samples: list[str] = field(default_factory=list)
    above_resident: Counter[int] = field(default_factory=Counter)
    """GPU samples by how many engines held more than their resident memory."""
    peak_used_bytes: int = 0
    """The most memory in use a GPU sample showed, and that GPU's total."""
    peak_total_bytes: int = 0
    gpu_samples: int = 0
    sample_gaps: dict[str, float] = field(default_factory=dict)
    """The time between the starts of two samples of one GPU: count, p50, p99, max (ms)."""
    unowned_gpus: list[str] = field(default_factory=list)
    unreachable: list[dict[str, Any]] = field(default_factory=list)
    """When the campaign failed: what the logs say of each engine that did not answer at
    the end (:func:`e2e.chaos.evidence.unreachable_engine`)."""
    seconds: float = 0.0

    def clean(self) -> bool:
        """The campaign's targets: no two awake (awake-set mode: no GPU's memory over its
        total, never more awake than fit), every request answered, every GPU owned."""
        sampled = (self.over_gpu == 0 and self.crowded == 0 if self.mode == AWAKE_SET
                   else self.double_awake == 0)
        return sampled and not self.unowned_gpus and self.answers[Answer.UNANSWERED] == 0

    def switch(self, *, ok: bool, reason: str = "") -> None:
        self.switches += 1
        if not ok:
            self.failed_switches += 1
            self.failures[reason or "unknown"] += 1

    def answer(self, kind: str, detail: str = "") -> None:
        self.answers[kind] += 1
        if kind == Answer.REFUSED:
            self.refusals[detail.split(": ", 1)[-1]] += 1
        if kind == Answer.UNANSWERED and len(self.unanswered_samples) < 20:
            self.unanswered_samples.append(detail[:300])

    def report(self) -> dict[str, Any]:
        if self.mode == AWAKE_SET:
            sampled: dict[str, Any] = {
                "over_gpu_instants": self.over_gpu, "crowded_instants": self.crowded,
                "samples_by_engines_above_resident": dict(sorted(self.above_resident.items())),
                "peak_gpu_bytes": self.peak_used_bytes, "gpu_total_bytes": self.peak_total_bytes}
            examples: dict[str, Any] = {"over_gpu": self.over_gpu_samples[:20],
                                        "crowded": self.crowded_samples[:20]}
        else:
            sampled = {"double_awake_instants": self.double_awake}
            examples = {"double_awake": self.double_awake_samples[:20]}
        return {
            "mode": self.mode,
            "switches": self.switches, "failed_switches": self.failed_switches,
            "failures_by_reason": dict(self.failures.most_common()),
            **sampled, "gpu_samples": self.gpu_samples,
            "gpu_sample_gaps": self.sample_gaps,
            "requests": dict(self.answers),
            "requests_without_answer": self.answers[Answer.UNANSWERED],
            "refusals": dict(self.refusals.most_common()),
            "gpus_without_owner": len(self.unowned_gpus),
            "faults_injected": dict(self.faults.most_common()),
            "faults_without_effect": dict(self.faults_missed.most_common()),
            "seconds": round(self.seconds, 1),
            "samples": {"unanswered": self.unanswered_samples, **examples,
                        "unowned": self.unowned_gpus,
                        "unreachable_engines": self.unreachable},
        }

    def lines(self) -> list[str]:
        r = self.report()
        rate = r["switches"] / self.seconds if self.seconds else 0.0
        out = [
            f"mode                     {self.mode}",
            f"switches                 {r['switches']} ({r['failed_switches']} failed, "
            f"{rate:.1f}/s over {r['seconds']} s)",
            *self._sampled_lines(),
            "GPU sampled every        " + (
                f"{self.sample_gaps['p50_ms']} ms p50, {self.sample_gaps['p99_ms']} ms p99, "
                f"{self.sample_gaps['max_ms']} ms at most" if self.sample_gaps else "-"),
            f"requests without answer  {r['requests_without_answer']} of "
            f"{sum(self.answers.values())} (target 0; refused with Retry-After: "
            f"{self.answers[Answer.REFUSED]})",
            "refused, by reason       " + (", ".join(f"{k} {v}" for k, v in
                                                   self.refusals.most_common(8)) or "none"),
            f"GPUs left without owner  {r['gpus_without_owner']} (target 0)",
            "failures by reason       " + (", ".join(f"{k} {v}" for k, v in
                                                   self.failures.most_common()) or "none"),
            "faults injected          " + (", ".join(f"{k} {v}" for k, v in
                                                   self.faults.most_common()) or "none"),
        ]
        for engine in self.unreachable:
            out.append(f"engine not answering     {engine['engine']} (claim "
                       f"{engine['claim'] or '?'}); start gate: "
                       f"{', '.join(engine['start_gate']) or '-'}")
            out += [f"  {source}: {line}" for source in ("node_agent", "container")
                    for line in engine[source][-3:]]
        return out

    def _sampled_lines(self) -> list[str]:
        if self.mode != AWAKE_SET:
            return [f"two engines awake        {self.double_awake} instants "
                    f"in {self.gpu_samples} GPU samples (target 0)"]
        by_count = ", ".join(f"{k}: {v}" for k, v in sorted(self.above_resident.items()))
        return [
            f"GPU memory over total    {self.over_gpu} instants in {self.gpu_samples} GPU "
            f"samples (target 0); at most {format_bytes(self.peak_used_bytes)} in use of "
            f"{format_bytes(self.peak_total_bytes)}",
            f"more awake than fit      {self.crowded} instants (target 0)",
            f"engines above resident   samples by count: {by_count or '-'}",
        ]

    def json_line(self) -> str:
        return json.dumps(self.report(), sort_keys=True)
