"""The admin's binding bounds every knob of a claim that buys GPU time
(controller/lease/tenants.py), before the switch policy (controller/lease/policy.py) reads
it. On the old code only ``priority`` was bounded: a tenant held to priority 0 asked for
``maxWaitSeconds: 0.001`` and preempted a busy priority-100 holder at once."""

from __future__ import annotations

import logging
import math
from typing import Any

import pytest

from controller.claimants import Claimant
from controller.lease.policy import (
    Action,
    ClaimQueue,
    GpuView,
    ModelPolicy,
    PolicyInput,
    SwitchCost,
    decide,
    policy_for,
)
from controller.lease.settings import load
from controller.lease.tenants import MAX_WAIT_FLOOR_S, Binding, TenantLimits, bound, bounded
from rota.api.engine_config import EngineConfig, parse_engine_config
from rota.kit.errors import ConfigError

DEFAULT = ModelPolicy(priority=0, max_wait_s=30.0, share_weight=1.0, keep_alive_s=600.0)
COST = SwitchCost(sleep_s=0.5, wake_s=0.6, probe_s=0.1)


def _config(**fields: object) -> EngineConfig:
    return parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                "kind": "EngineConfig", "model": "m", "awakeMemory": "8Gi",
                                **fields})


def _policy(namespace: str, binding: Binding, default: ModelPolicy = DEFAULT,
            **fields: object) -> ModelPolicy:
    return policy_for(bound(_config(**fields), namespace, default, binding).config, default)


def _busy_holder_and_tiny_bound(now: float, binding: Binding) -> PolicyInput:
    """The review's scenario: prod's priority-100 engine holds the GPU with 3 requests in
    flight; team-b's claim (held to priority 0) asks for maxWaitSeconds 0.001, its
    request arrived at t=100."""
    return PolicyInput(
        gpu=GpuView(now=now, holder="a", awake_since=90.0, in_flight=3, last_request=now),
        queues=(ClaimQueue("b", 1, 100.0),),
        policies={"a": _policy("prod", binding, priority=100),
                  "b": _policy("team-b", binding, priority=50, maxWaitSeconds=0.001)},
        costs={"a": COST, "b": COST}, default_policy=DEFAULT)


def test_a_tenant_held_to_priority_0_does_not_preempt_with_a_tiny_bound() -> None:
    binding: Binding = {"prod": 100, "team-b": 0}
    first = decide(_busy_holder_and_tiny_bound(100.001, binding))
    assert (first.action, first.rule) == (Action.STAY, "stay"), first.reason
    # Its bound is the node's 30 s: due once the wait plus the 1.2 s switch reach it.
    due = 100.0 + 30.0 - (COST.sleep_s + COST.wake_s + COST.probe_s)
    assert first.recheck_at == pytest.approx(due)
    before = decide(_busy_holder_and_tiny_bound(due - 0.01, binding))
    assert before.action is Action.STAY, "not before the holder's due time"
    at = decide(_busy_holder_and_tiny_bound(due, binding))
    assert (at.action, at.target, at.rule) == (Action.SWITCH, "b", "bounded_wait"), \
        "the bound still holds, at the length the admin allows"
    assert "of its 30 s bound" in at.reason


def test_without_a_binding_a_bound_is_never_shorter_than_the_floor() -> None:
    early = decide(_busy_holder_and_tiny_bound(101.0, {}))
    assert early.action is Action.STAY, early.reason
    assert early.recheck_at == pytest.approx(100.0 + MAX_WAIT_FLOOR_S - 1.2)
    assert _policy("any", {}, maxWaitSeconds=0.001).max_wait_s == MAX_WAIT_FLOOR_S
    assert _policy("any", {}, maxWaitSeconds=12).max_wait_s == 12, "a sane bound stands"
    short = ModelPolicy(max_wait_s=2.0)
    assert _policy("any", {}, short, maxWaitSeconds=0.5).max_wait_s == 2.0, \
        "the floor is never above the node's own default bound"
    trusted = _policy("any", {}, priority=900, shareWeight=50, keepAliveSeconds=86400,
                      home=True)
    assert (trusted.priority, trusted.share_weight, trusted.keep_alive_s) == (
        900, 50.0, 86400.0), "no binding: the other values stand"
    assert bound(_config(home=True), "any", DEFAULT, {}).config.home


def test_each_knob_is_held_to_what_the_namespace_may_take() -> None:
    binding: Binding = {"team-a": TenantLimits(priority=10, max_wait_seconds=60,
                                               share_weight=2, keep_alive_seconds=120,
                                               home=False)}
    asked = _config(priority=500, maxWaitSeconds=0.001, shareWeight=1000,
                    keepAliveSeconds=86400, home=True)
    result = bound(asked, "team-a", DEFAULT, binding)
    got = policy_for(result.config, DEFAULT)
    assert (got.priority, got.max_wait_s, got.share_weight, got.keep_alive_s) == (
        10, 60.0, 2.0, 120.0)
    assert not result.config.home
    assert result.changed == {"priority": (500, 10), "maxWaitSeconds": (0.001, 60),
                              "shareWeight": (1000.0, 2), "keepAliveSeconds": (86400.0, 120),
                              "home": (True, False)}
    assert result.limits.entry == "team-a"
    within = bound(_config(priority=3, maxWaitSeconds=90, shareWeight=1.5,
                           keepAliveSeconds=60), "team-a", DEFAULT, binding)
    assert within.changed == {}, "values within the bounds stand as written"


def test_what_an_entry_leaves_out_is_held_to_the_nodes_default() -> None:
    binding: Binding = {"prod": 100, "team-*": TenantLimits(max_wait_seconds=5),
                        "*-dev": -5}
    prod = _policy("prod", binding, priority=100, maxWaitSeconds=1, shareWeight=9,
                   keepAliveSeconds=3600)
    assert (prod.priority, prod.max_wait_s, prod.share_weight, prod.keep_alive_s) == (
        100, 30.0, 1.0, 600.0), "a plain number bounds the priority; the rest: defaults"
    team = _policy("team-dev", binding, priority=7, maxWaitSeconds=1)
    assert (team.priority, team.max_wait_s) == (0, 5.0), "the first pattern that matches"
    assert _policy("x-dev", binding).priority == -5, "a left-out priority is bounded too"
    other = _policy("other", binding, priority=7, maxWaitSeconds=1, shareWeight=3)
    assert (other.priority, other.max_wait_s, other.share_weight) == (0, 30.0, 1.0), \
        "a namespace the binding does not name: the node's defaults"
    assert not bound(_config(home=True), "other", DEFAULT, binding).config.home
    granted = {"prod": TenantLimits(home=True, share_weight=4, max_wait_seconds=0.5)}
    mine = bound(_config(home=True, shareWeight=3, maxWaitSeconds=1), "prod", DEFAULT,
                 granted)
    assert mine.changed == {}, "the admin may grant more than the node's default"


def test_a_forever_keep_alive_default_is_no_bound() -> None:
    forever = ModelPolicy(keep_alive_s=math.inf)
    assert _policy("team-a", {"team-a": 0}, forever, keepAliveSeconds=86400
                   ).keep_alive_s == 86400
    held = bound(_config(), "team-a", forever,
                 {"team-a": TenantLimits(keep_alive_seconds=60)})
    assert held.config.keep_alive_seconds == 60, "a left-out keep-alive is bounded too"


def _claimant(namespace: str, config: EngineConfig) -> Claimant:
    return Claimant(claim_uid=f"uid-{namespace}", namespace=namespace, claim_name="c",
                    node="n", device="gpu-0", share_id=None, config=config, model="m",
                    port=8000, sleep_level=1, resident_bytes=1, pod_name=None, pod_uid=None,
                    pod_ip=None, pod_ready=False, pod_deleting=False)


def test_the_bound_that_applied_is_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="controller.lease.tenants")
    claimant = _claimant("team-log", _config(priority=50, maxWaitSeconds=0.001))
    binding: Binding = {"team-log": 0}
    for _ in range(3):
        assert bounded(claimant, DEFAULT, binding).max_wait_seconds == 30
    records: list[Any] = [r for r in caplog.records
                          if r.getMessage() == "switch policy bounded by the admin"]
    assert len(records) == 1
    assert (records[0].claim, records[0].entry) == ("team-log/c", "team-log")
    assert records[0].asked == {"priority": 50, "maxWaitSeconds": 0.001}
    assert records[0].given == {"priority": 0, "maxWaitSeconds": 30.0}


def test_the_binding_is_parsed_from_the_controllers_settings() -> None:
    s = load(["--node-name", "n", "--policy-priority-ceilings",
              '{"prod": 100, "team-*": {"priority": 10, "maxWaitSeconds": 60, '
              '"shareWeight": 2, "keepAliveSeconds": 300, "home": true}}'])
    assert s.policy_priority_ceilings.root == {"prod": 100, "team-*": TenantLimits(
        priority=10, max_wait_seconds=60, share_weight=2, keep_alive_seconds=300,
        home=True)}
    for bad in ('{"x": {"maxWait": 5}}', '{"x": {"maxWaitSeconds": 0}}', '{"x": 5000}',
                '{"x": "high"}'):
        with pytest.raises(ConfigError, match="policy_priority_ceilings"):
            load(["--node-name", "n", "--policy-priority-ceilings", bad])
