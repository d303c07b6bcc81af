"""The drain mode is today's policy, and rota mode is the same wherever no claim keeps its
requests (controller/lease/policy.py). Preemption is new behaviour; these tests pin that
it never leaks into the cases it does not apply to: the existing decision tests run
unchanged against ``drain`` (each decision also compared with ``rota``'s on the same
input), random inputs without a claim that keeps requests decide alike in both modes,
``drain`` never preempts, and ``rota`` preempts only a holder whose claim keeps requests."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from controller.lease.policy import (
    Action,
    ClaimQueue,
    Decision,
    GpuView,
    KeptWork,
    ModelPolicy,
    PolicyInput,
    PolicyMode,
    SwitchCost,
    decide,
)
from tests.controller import test_policy_decisions as existing

pytestmark = pytest.mark.controller

PROPERTY = settings(max_examples=120, deadline=None, derandomize=True)
"""Deterministic (the same examples on every run), no per-example deadline."""

CLAIMS = ("a", "b", "c", "d")


def _in_mode(inp: PolicyInput, mode: PolicyMode) -> PolicyInput:
    return dataclasses.replace(inp, default_policy=dataclasses.replace(inp.default_policy,
                                                                       mode=mode))


def _drain_checked(inp: PolicyInput) -> Decision:
    """The drain mode's decision, after checking rota mode decides the same."""
    drain = decide(_in_mode(inp, PolicyMode.DRAIN))
    assert decide(_in_mode(inp, PolicyMode.ROTA)) == drain, "rota differs from drain"
    assert not drain.preempt
    return drain


def _existing_tests() -> list[tuple[str, Callable[[], None]]]:
    return [(name, fn) for name, fn in inspect.getmembers(existing, inspect.isfunction)
            if name.startswith("test_") and fn.__module__ == existing.__name__
            and not inspect.signature(fn).parameters]


@pytest.mark.parametrize(("name", "test"), _existing_tests(),
                         ids=[n for n, _ in _existing_tests()])
def test_the_existing_decision_tests_hold_in_drain_mode(
        name: str, test: Callable[[], None], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(existing, "decide", _drain_checked)
    test()


def test_the_existing_tests_were_found() -> None:
    names = {n for n, _ in _existing_tests()}
    assert "test_the_starvation_bound_holds_under_a_steady_busy_holder" in names
    assert len(names) >= 15


times = st.floats(min_value=0.0, max_value=200.0, allow_nan=False)


@st.composite
def inputs(draw: st.DrawFn, *, keeps: st.SearchStrategy[bool]) -> PolicyInput:
    """A random GPU: a holder or none, its load, queues, per-claim policies and costs,
    sleeping claimants' kept work (only for claims that keep requests), usage."""
    now = draw(st.floats(min_value=50.0, max_value=300.0))
    holder = draw(st.sampled_from((None, *CLAIMS)))
    policies = {c: ModelPolicy(
        priority=draw(st.integers(-2, 2)), max_wait_s=draw(st.floats(2.0, 60.0)),
        first_token_s=draw(st.floats(0.5, 5.0)), longest_freeze_s=draw(st.floats(1.0, 8.0)),
        keeps_requests=draw(keeps), keep_alive_s=draw(st.sampled_from((0.0, 10.0, 1e9))))
        for c in CLAIMS}
    costs = {c: SwitchCost(sleep_s=draw(st.floats(0.01, 1.0)),
                           wake_s=draw(st.floats(0.01, 1.0)),
                           probe_s=draw(st.floats(0.01, 0.3))) for c in CLAIMS}
    queues = tuple(ClaimQueue(c, draw(st.integers(0, 5)),
                              now - draw(st.floats(0.0, 40.0)))
                   for c in draw(st.lists(st.sampled_from(CLAIMS), unique=True)))
    kept = {c: KeptWork(draw(st.integers(1, 6)), now - draw(st.floats(0.0, 4.0)),
                        draw(st.integers(0, 20_000)))
            for c in draw(st.lists(st.sampled_from(CLAIMS), unique=True))
            if c != holder and policies[c].keeps_requests}
    gpu = GpuView(now=now, holder=holder, awake_since=now - draw(st.floats(0.0, 30.0)),
                  last_request=now - draw(st.floats(0.0, 100.0)),
                  in_flight=draw(st.integers(0, 6)),
                  drain_estimate_s=draw(st.floats(0.0, 5.0)),
                  pending=draw(st.sampled_from((None, *CLAIMS))),
                  idle_since=now - draw(st.floats(0.0, 100.0)))
    usage = draw(st.dictionaries(st.sampled_from(CLAIMS), st.floats(0.0, 500.0)))
    return PolicyInput(gpu=gpu, queues=queues, policies=policies, costs=costs,
                       home=draw(st.sampled_from((None, *CLAIMS))), usage_s=usage,
                       kept=kept)


@PROPERTY
@given(inputs(keeps=st.just(False)))
def test_rota_decides_as_drain_when_no_claim_keeps_requests(inp: PolicyInput) -> None:
    assert decide(_in_mode(inp, PolicyMode.ROTA)) == decide(_in_mode(inp, PolicyMode.DRAIN))


@PROPERTY
@given(inputs(keeps=st.booleans()))
def test_only_a_holder_that_keeps_its_requests_is_ever_preempted(inp: PolicyInput) -> None:
    rota = decide(_in_mode(inp, PolicyMode.ROTA))
    if rota.preempt:
        assert rota.action is Action.SWITCH
        assert inp.gpu.holder is not None
        assert inp.policies[inp.gpu.holder].keeps_requests
        assert inp.gpu.in_flight > 0, "an idle holder has nothing to keep"
    for mode in (PolicyMode.DRAIN, PolicyMode.FIRST_COME):
        assert not decide(_in_mode(inp, mode)).preempt, mode


@PROPERTY
@given(inputs(keeps=st.booleans()))
def test_every_decision_names_a_known_rule_and_a_waiting_target(inp: PolicyInput) -> None:
    from controller.lease.policy import RULES

    for mode in PolicyMode:
        d = decide(_in_mode(inp, mode))
        assert d.rule in RULES
        if d.action is Action.SWITCH and d.rule not in ("home_return",):
            waiting = {q.claim for q in inp.queues if q.length > 0} | set(inp.kept)
            assert d.target in waiting, (mode, d)


def _kw(**kw: Any) -> dict[str, Any]:
    return kw


def test_drain_mode_drains_a_holder_that_keeps_requests() -> None:
    """The one input where the modes differ: a busy holder that keeps its requests, a
    waiter due at its first token."""
    keeps = {"a": ModelPolicy(keeps_requests=True), "b": ModelPolicy(keeps_requests=True)}
    inp = PolicyInput(gpu=GpuView(now=101.8, holder="a", awake_since=90.0, in_flight=3),
                      queues=(ClaimQueue("b", 1, 100.0),), policies=keeps,
                      costs={"a": SwitchCost(0.05, 0.05, 0.05),
                             "b": SwitchCost(0.05, 0.05, 0.05)})
    rota = decide(inp)
    drain = decide(_in_mode(inp, PolicyMode.DRAIN))
    assert (rota.action, rota.rule, rota.preempt) == (Action.SWITCH, "first_token_due", True)
    assert not drain.preempt
    assert drain.rule != "first_token_due"
