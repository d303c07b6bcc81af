"""The lease controller's metric labels stay bounded and say what they should: every
failure reason the code can give is a known label (anything else is counted as ``other``,
its text kept in the Lease), and switch timings carry the served model name."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from controller.lease import metrics
from tests.controller.conftest import EngineSimFactory
from tests.controller.switch_kit import make_kit

pytestmark = [pytest.mark.controller]

ROOT = Path(__file__).resolve().parents[2] / "controller" / "lease"
REASON_NAMES = {"reason"}
"""Assignments to these names (``reason = ...``, ``self.reason = ...``) and keywords of
this name (``reason=...``) in the engine adapters give a failure its reason."""
FAILURE_CALLS = {"SwitchFailed", "HandbackProblem"}
"""Calls whose first argument is a failure reason."""


def _strings(node: ast.AST) -> Iterator[str]:
    """The string constants an expression can take (``a if c else b`` gives both)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        yield node.value
    elif isinstance(node, ast.IfExp):
        yield from _strings(node.body)
        yield from _strings(node.orelse)
    elif isinstance(node, ast.BoolOp):
        for value in node.values:
            yield from _strings(value)


def _target_name(target: ast.expr) -> str | None:
    if isinstance(target, ast.Name):
        return target.id
    if isinstance(target, ast.Attribute):
        return target.attr
    return None


def _call_name(call: ast.Call) -> str | None:
    return _target_name(call.func)


def reasons_in_engines() -> set[str]:
    found: set[str] = set()
    for path in (ROOT / "engines").glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and any(
                    _target_name(t) in REASON_NAMES for t in node.targets):
                found |= set(_strings(node.value))
            elif isinstance(node, ast.Call):
                found |= {s for k in node.keywords if k.arg in REASON_NAMES
                          for s in _strings(k.value)}
            elif isinstance(node, ast.FunctionDef) and node.name == "_classify":
                found |= {s for r in ast.walk(node) if isinstance(r, ast.Return) and r.value
                          for s in _strings(r.value)}
    return found


def reasons_in_the_switch() -> set[str]:
    found: set[str] = set()
    for path in ROOT.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = _call_name(node)
            is_failures = (name == "labels" and isinstance(node.func, ast.Attribute)
                           and _target_name(node.func.value) == "FAILURES")
            if name in FAILURE_CALLS or is_failures:
                found |= set(_strings(node.args[0]))
    return found


def test_the_scan_finds_the_reasons() -> None:
    # So that a scan that stopped finding anything cannot pass.
    assert {"unreachable", "gpu_oom", "host_oom", "ack_error", "engine_dead"} \
        <= reasons_in_engines()
    assert {"start_timeout", "memory_not_returned", "controller_crash"} \
        <= reasons_in_the_switch()


def test_every_failure_reason_the_code_gives_is_a_known_label() -> None:
    given = reasons_in_engines() | reasons_in_the_switch()
    assert given - metrics.SWITCH_FAILURE_REASONS == set()


def test_an_unknown_reason_is_other() -> None:
    assert metrics.failure_reason("gpu_oom") == "gpu_oom"
    assert metrics.failure_reason("probe_wrong_content") == "probe_wrong_content"
    assert metrics.failure_reason("keyerror") == metrics.OTHER_REASON


def _value(name: str, **labels: str) -> float:
    return metrics.REGISTRY.get_sample_value(name, labels) or 0.0


async def test_a_switch_that_fails_for_no_known_reason_counts_as_other(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    a = await engine_sim_factory(model="m/a")
    b = await engine_sim_factory(model="m/b")
    kit = make_kit(engine_session, [("a", a), ("b", b)])
    ca, cb = kit.claimants
    await kit.switcher.ports.engine(cb).sleep(1)
    lease = kit.holding(ca)

    def broken_read() -> None:
        raise LookupError("the device read broke")

    kit.device.on_read.append(broken_read)
    failures = "rota_controller_switch_failures_total"
    before = _value(failures, reason=metrics.OTHER_REASON)
    failed = _value("rota_controller_switches_total", outcome="failed")
    result = await kit.switcher.switch(lease, holder=ca, target=cb, claimants=kit.claimants)
    assert not result.ok
    assert result.reason == "lookuperror"
    assert result.lease.last_error.startswith("lookuperror: the device read broke")
    assert _value(failures, reason=metrics.OTHER_REASON) == before + 1
    assert metrics.REGISTRY.get_sample_value(failures, {"reason": "lookuperror"}) is None
    assert _value("rota_controller_switches_total", outcome="failed") == failed + 1


async def test_switch_timings_carry_the_served_model_name(
        engine_sim_factory: EngineSimFactory, engine_session: aiohttp.ClientSession) -> None:
    a = await engine_sim_factory(model="org/model-a")
    b = await engine_sim_factory(model="org/model-b")
    kit = make_kit(engine_session, [("a", a), ("b", b)])
    ca, cb = kit.claimants
    await kit.switcher.ports.engine(cb).sleep(1)
    lease = kit.holding(ca)
    counts = {
        "handoff": ("rota_controller_handoff_duration_seconds_count", {"model_name": cb.model}),
        "wake": ("rota_controller_wake_duration_seconds_count",
                 {"model_name": cb.model, "level": "1"}),
        "recovery": ("rota_controller_recovery_duration_seconds_count",
                     {"model_name": cb.model}),
        "drain": ("rota_controller_drain_duration_seconds_count", {"model_name": ca.model}),
        "sleep": ("rota_controller_sleep_duration_seconds_count",
                  {"model_name": ca.model, "level": "1", "first": "true"}),
    }
    before = {k: _value(name, **labels) for k, (name, labels) in counts.items()}
    result = await kit.switcher.switch(lease, holder=ca, target=cb, claimants=kit.claimants)
    assert result.ok, result.message
    assert {k: _value(name, **labels) - before[k] for k, (name, labels) in counts.items()} \
        == dict.fromkeys(counts, 1.0)
