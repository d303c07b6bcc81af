"""The simulator's example is Ready, as the vLLM example is, only once its engine answers
``/health``: README's quick start runs it in vLLM's place and sends a request right after
``kubectl wait --for=condition=Ready`` (without a probe the pod was Ready before the
simulator listened, and that request could not wake the engine: unreachable)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

EXAMPLES = Path(__file__).resolve().parents[2] / "manifests" / "examples"


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec") or {}
    if doc.get("kind") != "Pod":
        spec = (spec.get("template") or {}).get("spec") or {}
    return list(spec.get("containers") or [])


def _probes(name: str) -> list[Any]:
    docs = [d for d in yaml.safe_load_all((EXAMPLES / name).read_text()) if d]
    return [c.get("readinessProbe") for d in docs for c in _containers(d)
            if d.get("kind") in ("Pod", "Deployment", "StatefulSet")]


def test_every_engine_of_the_simulator_example_has_the_vllm_examples_readiness_probe() -> None:
    vllm = _probes("vllm-two-models.yaml")
    assert vllm
    assert all(p == vllm[0] for p in vllm)
    simulator = _probes("two-models.yaml")
    assert len(simulator) == 2
    assert all(p == vllm[0] for p in simulator), simulator
