"""What a campaign counts, and its report: pure bookkeeping, no I/O."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Answer", "Tally"]


class Answer:
    """How a client request ended (a label)."""

    OK = "ok"
    """200 and a complete answer (a stream ending in ``[DONE]``)."""
    REFUSED = "refused"
    """An explicit 429/503 with ``Retry-After``: an answer, by the campaign's rule."""
    UNANSWERED = "unanswered"
    """Anything else: a connection error, a timeout, a 5xx without Retry-After, a stream
    cut short. The campaign's target is zero of these."""


@dataclass
class Tally:
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
    gpu_samples: int = 0
    sample_gaps: dict[str, float] = field(default_factory=dict)
    """The time between the starts of two samples of one GPU: count, p50, p99, max (ms)."""
    unowned_gpus: list[str] = field(default_factory=list)
    unreachable: list[dict[str, Any]] = field(default_factory=list)
    """When the campaign failed: what the logs say of each engine that did not answer at
    the end (:func:`e2e.chaos.evidence.unreachable_engine`)."""
    seconds: float = 0.0

    def clean(self) -> bool:
        """The campaign's targets: no two awake, every request answered, every GPU owned."""
        return (self.double_awake == 0 and not self.unowned_gpus
                and self.answers[Answer.UNANSWERED] == 0)

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
        return {
            "switches": self.switches, "failed_switches": self.failed_switches,
            "failures_by_reason": dict(self.failures.most_common()),
            "double_awake_instants": self.double_awake, "gpu_samples": self.gpu_samples,
            "gpu_sample_gaps": self.sample_gaps,
            "requests": dict(self.answers),
            "requests_without_answer": self.answers[Answer.UNANSWERED],
            "refusals": dict(self.refusals.most_common()),
            "gpus_without_owner": len(self.unowned_gpus),
            "faults_injected": dict(self.faults.most_common()),
            "faults_without_effect": dict(self.faults_missed.most_common()),
            "seconds": round(self.seconds, 1),
            "samples": {"unanswered": self.unanswered_samples,
                        "double_awake": self.double_awake_samples[:20],
                        "unowned": self.unowned_gpus,
                        "unreachable_engines": self.unreachable},
        }

    def lines(self) -> list[str]:
        r = self.report()
        rate = r["switches"] / self.seconds if self.seconds else 0.0
        out = [
            f"switches                 {r['switches']} ({r['failed_switches']} failed, "
            f"{rate:.1f}/s over {r['seconds']} s)",
            f"two engines awake        {r['double_awake_instants']} instants "
            f"in {r['gpu_samples']} GPU samples (target 0)",
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

    def json_line(self) -> str:
        return json.dumps(self.report(), sort_keys=True)
