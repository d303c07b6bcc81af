"""The switch policy's decision function (controller/lease/policy.py), one rule at a time."""

from __future__ import annotations

import math

import pytest

from controller.lease.policy import (
    RULES,
    Action,
    ClaimQueue,
    GpuView,
    ModelPolicy,
    PolicyInput,
    SwitchCost,
    decide,
    policy_for,
)
from rota.api.engine_config import parse_engine_config
from rota.api.errors import OpaqueConfigError

COST = {"a": SwitchCost(sleep_s=0.5, wake_s=0.6, probe_s=0.1),
        "b": SwitchCost(sleep_s=0.05, wake_s=0.05, probe_s=0.05),
        "c": SwitchCost(sleep_s=0.3, wake_s=0.3, probe_s=0.1)}


def _inp(*, holder: str | None = "a", now: float = 100.0, awake_since: float = 0.0,
         in_flight: int = 3, queues: tuple[ClaimQueue, ...] = (),
         policies: dict[str, ModelPolicy] | None = None, **kw: object) -> PolicyInput:
    gpu_kw = {k: kw.pop(k) for k in ("last_request", "pending", "idle_since",
                                     "drain_estimate_s") if k in kw}
    gpu = GpuView(now=now, holder=holder, awake_since=awake_since, in_flight=in_flight,
                  **gpu_kw)  # type: ignore[arg-type]
    return PolicyInput(gpu=gpu, queues=queues, policies=policies or {}, costs=COST,
                       **kw)  # type: ignore[arg-type]


def test_an_idle_holder_gives_way_at_once_whatever_its_keep_alive() -> None:
    # make demo's case: holder woken a moment ago, nothing in flight, a client waits.
    d = decide(_inp(awake_since=99.9, in_flight=0, last_request=99.9,
                    policies={"a": ModelPolicy(keep_alive_s=300)},
                    queues=(ClaimQueue("b", 1, 99.95),)))
    assert (d.action, d.target, d.rule) == (Action.SWITCH, "b", "holder_idle")


def test_a_busy_holder_keeps_its_quantum_then_the_waiter_is_served() -> None:
    q = (ClaimQueue("b", 2, 99.0),)
    inside = decide(_inp(awake_since=98.0, queues=q))
    assert (inside.action, inside.rule) == (Action.STAY, "quantum")
    # quantum = max(1, 4 x (0.5 + 0.05 + 0.05)) = 2.4 s after the wake
    assert inside.recheck_at == pytest.approx(100.4)
    after = decide(_inp(now=100.5, awake_since=98.0, queues=q))
    assert (after.action, after.target, after.rule) == (Action.SWITCH, "b", "cost")


def test_the_quantum_is_a_multiple_of_the_measured_cost() -> None:
    q = (ClaimQueue("b", 1, 99.0),)
    slow = {"a": SwitchCost(sleep_s=5.0, wake_s=0.6, probe_s=0.1),
            "b": COST["b"]}
    d = decide(PolicyInput(gpu=GpuView(now=110.0, holder="a", awake_since=95.0,
                                       in_flight=1), queues=q, costs=slow))
    assert (d.action, d.rule) == (Action.STAY, "quantum")  # 4 x 5.1 s = 20.4 s


def test_bounded_wait_preempts_a_busy_higher_priority_holder() -> None:
    policies = {"a": ModelPolicy(priority=10), "b": ModelPolicy(priority=0, max_wait_s=20)}
    early = decide(_inp(awake_since=99.0, queues=(ClaimQueue("b", 1, 90.0),),
                        policies=policies))
    assert early.action is Action.STAY
    assert early.recheck_at is not None
    assert early.recheck_at <= 90.0 + 20.0
    # oldest wait 19.5 s + switch 0.6 s >= 20 s: served now, quantum or not.
    late = decide(_inp(now=109.5, awake_since=109.0, queues=(ClaimQueue("b", 1, 90.0),),
                       policies=policies))
    assert (late.action, late.target, late.rule) == (Action.SWITCH, "b", "bounded_wait")


def test_the_starvation_bound_holds_under_a_steady_busy_holder() -> None:
    """Replay: a holder that is always busy and a quiet model's one request; the request
    is served before its bound."""
    policies = {"b": ModelPolicy(max_wait_s=10.0)}
    now, holder, awake_since = 0.0, "a", 0.0
    while holder == "a":
        d = decide(_inp(now=now, awake_since=awake_since, in_flight=8,
                        queues=(ClaimQueue("b", 1, 0.0),), policies=policies,
                        default_policy=ModelPolicy(quantum_factor=1e6)))
        if d.action is Action.SWITCH:
            holder = d.target or ""
        now += 0.25
    assert holder == "b"
    assert now <= 10.0


def test_the_longest_wait_against_its_bound_weighs_more() -> None:
    policies = {"b": ModelPolicy(max_wait_s=10), "c": ModelPolicy(max_wait_s=60)}
    d = decide(_inp(now=100.0, awake_since=99.5, queues=(
        ClaimQueue("b", 1, 90.0), ClaimQueue("c", 50, 39.0)), policies=policies))
    # both due: b at (10 + 0.65) / 10 before c at (61 + 0.8) / 60, whose queue is longer
    assert (d.target, d.rule) == ("b", "bounded_wait")


def test_a_higher_priority_request_preempts_and_its_drain_is_stated() -> None:
    policies = {"b": ModelPolicy(priority=5)}
    d = decide(_inp(awake_since=99.9, in_flight=4, queues=(ClaimQueue("b", 1, 99.95),),
                    policies=policies))
    assert (d.action, d.target, d.rule) == (Action.SWITCH, "b", "priority_preempt")
    assert "drain deadline" in d.reason


def test_a_lower_priority_waiter_does_not_preempt() -> None:
    policies = {"a": ModelPolicy(priority=5)}
    d = decide(_inp(awake_since=0.0, in_flight=2, queues=(ClaimQueue("b", 3, 99.0),),
                    policies=policies))
    assert (d.action, d.rule) == (Action.STAY, "stay")
    idle = decide(_inp(awake_since=0.0, in_flight=0, queues=(ClaimQueue("b", 3, 99.0),),
                       policies=policies))
    assert (idle.action, idle.target, idle.rule) == (Action.SWITCH, "b", "holder_idle")


def test_cost_aware_choice_prefers_the_longer_queue() -> None:
    d = decide(_inp(awake_since=0.0, queues=(ClaimQueue("b", 1, 99.0),
                                             ClaimQueue("c", 12, 99.0))))
    assert (d.target, d.rule) == ("c", "cost")


def test_a_waiter_below_the_switch_cost_waits_a_little() -> None:
    d = decide(_inp(awake_since=0.0, queues=(ClaimQueue("c", 1, 99.9),)))
    assert (d.action, d.rule) == (Action.STAY, "stay")  # 0.1 request-s < 0.8 s switch


def test_fair_share_damps_a_model_that_had_the_gpu() -> None:
    q = (ClaimQueue("b", 5, 99.0), ClaimQueue("c", 5, 99.0))
    plain = decide(_inp(holder=None, queues=q))
    assert plain.target == "b"  # the cheaper switch
    shared = decide(_inp(holder=None, queues=q, usage_s={"b": 900.0, "c": 10.0}))
    assert shared.target == "c"


def test_a_switch_whose_waiters_left_is_cancelled() -> None:
    d = decide(_inp(holder=None, pending="b", queues=(ClaimQueue("b", 0, 99.0),)))
    assert (d.action, d.rule) == (Action.CANCEL, "cancelled")
    still = decide(_inp(holder=None, pending="b", queues=(ClaimQueue("b", 1, 99.0),)))
    assert (still.action, still.target) == (Action.SWITCH, "b")


def test_the_home_return_is_not_cancelled() -> None:
    d = decide(_inp(holder=None, pending="a", home="a", idle_since=0.0, home_idle_s=30.0))
    assert (d.action, d.target, d.rule) == (Action.SWITCH, "a", "home_return")


def test_the_home_model_returns_after_the_idle_delay() -> None:
    early = decide(_inp(holder="b", in_flight=0, last_request=90.0, home="a",
                        home_idle_s=30.0))
    assert (early.action, early.rule) == (Action.STAY, "keep_alive")
    assert early.recheck_at == pytest.approx(120.0)
    late = decide(_inp(holder="b", now=121.0, in_flight=0, last_request=90.0, home="a",
                       home_idle_s=30.0))
    assert (late.action, late.target, late.rule) == (Action.SWITCH, "a", "home_return")
    idle_gpu = decide(_inp(holder=None, now=200.0, idle_since=150.0, home="a",
                           home_idle_s=30.0))
    assert (idle_gpu.action, idle_gpu.target) == (Action.SWITCH, "a")


def test_keep_alive_then_idle_sleep_without_a_home() -> None:
    policies = {"a": ModelPolicy(keep_alive_s=20.0)}
    early = decide(_inp(in_flight=0, last_request=90.0, policies=policies))
    assert (early.action, early.rule, early.recheck_at) == (Action.STAY, "keep_alive", 110.0)
    late = decide(_inp(now=111.0, in_flight=0, last_request=90.0, policies=policies))
    assert (late.action, late.rule) == (Action.SLEEP, "idle_sleep")
    forever = decide(_inp(now=1e6, in_flight=0, last_request=90.0))
    assert forever.action is Action.STAY
    assert forever.recheck_at is None


def test_the_home_model_itself_is_never_put_to_sleep_idle() -> None:
    d = decide(_inp(now=1e6, in_flight=0, last_request=0.0, home="a",
                    policies={"a": ModelPolicy(keep_alive_s=1.0)}))
    assert d.action is Action.STAY


def test_an_idle_gpu_serves_the_first_request() -> None:
    d = decide(_inp(holder=None, queues=(ClaimQueue("b", 1, 99.9),)))
    assert (d.action, d.target, d.rule) == (Action.SWITCH, "b", "first_request")


def test_every_rule_is_a_known_label() -> None:
    cases = [
        _inp(in_flight=0, queues=(ClaimQueue("b", 1, 99.0),)),
        _inp(awake_since=99.0, queues=(ClaimQueue("b", 1, 99.0),)),
        _inp(holder=None, pending="b"),
        _inp(in_flight=0, last_request=-math.inf),
    ]
    assert all(decide(c).rule in RULES for c in cases)


def test_policies_are_validated() -> None:
    with pytest.raises(ValueError, match="positive"):
        ModelPolicy(max_wait_s=0)
    with pytest.raises(ValueError, match="negative"):
        ModelPolicy(keep_alive_s=-1)


def test_the_claims_engine_config_sets_its_policy() -> None:
    base = {"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig", "model": "m",
            "awakeMemory": "8Gi"}
    default = ModelPolicy(max_wait_s=30.0, keep_alive_s=math.inf)
    plain = policy_for(parse_engine_config(base), default)
    assert plain == default
    mine = policy_for(parse_engine_config({**base, "priority": 7, "keepAliveSeconds": 12,
                                           "maxWaitSeconds": 5, "shareWeight": 2,
                                           "home": True}), default)
    assert (mine.priority, mine.keep_alive_s, mine.max_wait_s, mine.share_weight) == (
        7, 12.0, 5.0, 2.0)
    with pytest.raises(OpaqueConfigError, match="maxWaitSeconds"):
        parse_engine_config({**base, "maxWaitSeconds": 0})
    with pytest.raises(OpaqueConfigError, match="priority"):
        parse_engine_config({**base, "priority": "high"})
