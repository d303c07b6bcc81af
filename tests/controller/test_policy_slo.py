"""The service objectives of the switch policy (controller/lease/policy.py, ``rota``
mode): a waiter due at its first-token objective preempts a holder that keeps its
requests, a frozen stream near its longest freeze is woken first, a preemption that
would overrun a frozen stream drains instead, turns are sized by the switch share, and
sequential traffic switches at once. The objectives come from the claim, bounded by the
admin (controller/lease/tenants.py), with the node's defaults as flags."""

from __future__ import annotations

import pytest

from controller.lease.policy import (
    RULES,
    Action,
    ClaimQueue,
    GpuView,
    KeptWork,
    ModelPolicy,
    PolicyInput,
    SwitchCost,
    decide,
    policy_for,
    quantum_of,
)
from controller.lease.tenants import OBJECTIVE_FLOOR_S, TenantLimits, bound
from rota.api.engine_config import EngineConfig, parse_engine_config
from rota.api.errors import OpaqueConfigError
from tests.controller.test_policy_starvation import SimRequest, SwitchSimulator

pytestmark = pytest.mark.controller

FAST = SwitchCost(sleep_s=0.05, wake_s=0.05, probe_s=0.05)
KEEPS = ModelPolicy(keeps_requests=True)


def _inp(*, now: float, holder: str | None = "a", awake_since: float = 90.0,
         in_flight: int = 3, queues: tuple[ClaimQueue, ...] = (),
         policies: dict[str, ModelPolicy] | None = None,
         kept: dict[str, KeptWork] | None = None,
         costs: dict[str, SwitchCost] | None = None) -> PolicyInput:
    policies = policies if policies is not None else {"a": KEEPS, "b": KEEPS, "c": KEEPS}
    return PolicyInput(gpu=GpuView(now=now, holder=holder, awake_since=awake_since,
                                   in_flight=in_flight),
                       queues=queues, policies=policies,
                       costs=costs if costs is not None else dict.fromkeys(policies, FAST),
                       kept=kept or {})


def test_a_waiter_at_its_first_token_objective_preempts_a_holder_that_keeps_requests(
        ) -> None:
    q = (ClaimQueue("b", 1, 100.0),)
    # due once the wait + the 0.15 s switch + the reaction margin reach 2 s: at 101.75
    early = decide(_inp(now=100.5, awake_since=100.4, queues=q))
    assert (early.action, early.rule) == (Action.STAY, "quantum"), early.reason
    assert early.recheck_at is not None
    assert early.recheck_at <= 101.75 + 1e-9
    due = decide(_inp(now=101.75, awake_since=100.4, queues=q))
    assert (due.action, due.target, due.rule, due.preempt) == (
        Action.SWITCH, "b", "first_token_due", True)
    assert "a is preempted, its 3 requests kept" in due.reason


def test_a_holder_that_does_not_keep_requests_is_never_preempted_for_a_first_token(
        ) -> None:
    drains = {"a": ModelPolicy(), "b": KEEPS}
    d = decide(_inp(now=101.9, awake_since=101.0, queues=(ClaimQueue("b", 1, 100.0),),
                    policies=drains))
    assert not d.preempt
    assert d.rule != "first_token_due"
    assert (d.action, d.rule) == (Action.STAY, "quantum"), "today's quantum, as before"


def test_an_idle_holder_gives_way_at_once_without_a_preempt() -> None:
    d = decide(_inp(now=100.01, awake_since=100.0, in_flight=0,
                    queues=(ClaimQueue("b", 1, 100.0),)))
    assert (d.action, d.target, d.rule, d.preempt) == (Action.SWITCH, "b", "holder_idle",
                                                       False)


def test_a_frozen_stream_near_its_bound_is_woken_before_other_waiters() -> None:
    """b's kept streams have been frozen 2.7 s of 3 s; c's request is older and its
    queue longer, yet b comes back first."""
    d = decide(_inp(now=103.0, awake_since=100.4, queues=(ClaimQueue("c", 5, 99.0),),
                    kept={"b": KeptWork(2, 100.3, recompute_tokens=800)}))
    assert (d.action, d.target, d.rule, d.preempt) == (Action.SWITCH, "b", "freeze_bound",
                                                       True)
    assert "frozen 2.70 s of their 3 s bound" in d.reason


def test_a_sleeping_claimant_with_kept_work_waits_for_the_gpu_like_a_queue() -> None:
    """Nobody queued at the gateway: the kept requests alone bring their engine back
    when the GPU is free."""
    idle = decide(_inp(now=100.0, holder=None, in_flight=0,
                       kept={"b": KeptWork(1, 99.5)}))
    assert (idle.action, idle.target) == (Action.SWITCH, "b")
    holder_done = decide(_inp(now=100.0, in_flight=0, kept={"b": KeptWork(1, 99.5)}))
    assert (holder_done.action, holder_done.target, holder_done.rule) == (
        Action.SWITCH, "b", "holder_idle")
    pending = decide(PolicyInput(gpu=GpuView(now=100.0, holder=None, pending="b"),
                                 policies={"b": KEEPS}, kept={"b": KeptWork(1, 99.5)}))
    assert pending.action is not Action.CANCEL, "frozen streams still wait for the wake"


def test_a_preemption_that_would_overrun_a_frozen_stream_drains_instead() -> None:
    """c's streams have been frozen 2 s: preempting a for b (whose turn then lasts at
    least 3 x its switch) would bring c back past its 3 s bound, so a drains."""
    slow = {"a": SwitchCost(0.3, 0.3, 0.1), "b": SwitchCost(0.3, 0.3, 0.1),
            "c": SwitchCost(0.3, 0.3, 0.1)}
    d = decide(_inp(now=101.0, awake_since=90.0, queues=(ClaimQueue("b", 1, 99.5),),
                    kept={"c": KeptWork(1, 99.3)}, costs=slow,
                    policies={"a": KEEPS, "b": KEEPS,
                              "c": ModelPolicy(keeps_requests=True, priority=-1)}))
    assert d.action is Action.SWITCH
    assert not d.preempt, d.reason
    assert "drains (c's frozen streams would wait" in d.reason


def test_a_preemptible_turn_is_sized_by_the_switch_share() -> None:
    """A turn costs the switch and the target's recompute; the holder keeps the GPU at
    least (1 - share) / share times that: 3 x at the default 25 %, 1 x at 50 %."""
    inp = _inp(now=100.0, kept={"b": KeptWork(2, 99.0, recompute_tokens=5_000)},
               queues=(ClaimQueue("b", 1, 99.9),))
    switch = 0.05 + 0.05 + 0.05 + 5_000 / SwitchCost().recompute_tokens_per_s
    assert quantum_of(inp, "a", "b") == pytest.approx(3 * switch)
    half = PolicyInput(gpu=inp.gpu, queues=inp.queues, policies=inp.policies,
                       costs=inp.costs, kept=inp.kept,
                       default_policy=ModelPolicy(switch_share=0.5))
    assert quantum_of(half, "a", "b") == pytest.approx(switch)
    drains = PolicyInput(gpu=inp.gpu, queues=inp.queues, policies={"a": ModelPolicy()},
                         costs=inp.costs)
    assert quantum_of(drains, "a", "b") == pytest.approx(1.0), "today's quantum"


def test_past_its_turn_a_preemptible_holder_gives_way_at_once() -> None:
    """Its turn: 3 x (the switch in, 0.15 s, and its own sleep, 0.05 s) = 0.6 s."""
    within = decide(_inp(now=100.55, awake_since=100.0,
                         queues=(ClaimQueue("b", 1, 100.54),)))
    assert (within.action, within.rule) == (Action.STAY, "quantum")
    assert within.recheck_at == pytest.approx(100.6)
    d = decide(_inp(now=100.6, awake_since=100.0, queues=(ClaimQueue("b", 1, 100.59),)))
    assert (d.action, d.target, d.rule, d.preempt) == (Action.SWITCH, "b", "cost", True)


def test_sequential_traffic_gets_its_first_token_within_the_switch_plus_0_2_s() -> None:
    """One request at a time, the models alternating (each sent as the previous one
    ends): every first service within the switch's own cost plus 0.2 s."""
    claims = ("a", "b")
    cost = SwitchCost(sleep_s=0.06, wake_s=0.05, probe_s=0.04)
    requests, t = [], 0.0
    for i in range(20):
        requests.append(SimRequest(claims[i % 2], t, 0.5))
        t += 0.5 + 0.15 + 0.2 + 0.05  # its service, the switch, and a little more
    sim = SwitchSimulator(policies={c: KEEPS for c in claims},
                          costs=dict.fromkeys(claims, cost), requests=requests)
    sim.run()
    switch = cost.sleep_s + cost.wake_s + cost.probe_s
    late = [r for r in requests if r.first_service is None
            or r.first_service - r.arrival > switch + 0.2]
    assert not late, late


def test_sequential_traffic_against_a_busy_preemptible_holder_switches_at_once() -> None:
    """The holder is still streaming (its client sent the next request before reading
    the end): past its short turn it is preempted at once."""
    claims = ("a", "b")
    cost = SwitchCost(sleep_s=0.06, wake_s=0.05, probe_s=0.04)
    requests = [SimRequest("a", 0.0, 30.0), SimRequest("b", 2.0, 0.5),
                SimRequest("a", 4.0, 0.5), SimRequest("b", 6.0, 0.5)]
    sim = SwitchSimulator(policies={c: KEEPS for c in claims},
                          costs=dict.fromkeys(claims, cost), requests=requests)
    sim.run()
    switch = cost.sleep_s + cost.wake_s + cost.probe_s
    for r in requests[1:]:
        assert r.first_service is not None
        assert r.first_service - r.arrival <= switch + 0.2, (r, sim.trace)
    assert sim.preempts >= 2


def test_the_new_rules_are_labels() -> None:
    assert {"first_token_due", "freeze_bound"} <= set(RULES)


def _config(**fields: object) -> EngineConfig:
    return parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1",
                                "kind": "EngineConfig", "model": "m", "awakeMemory": "8Gi",
                                **fields})


def test_the_claim_sets_its_objectives_and_the_node_the_rest() -> None:
    default = ModelPolicy(first_token_s=2.0, longest_freeze_s=3.0, switch_share=0.2)
    plain = policy_for(_config(), default)
    assert (plain.first_token_s, plain.longest_freeze_s, plain.keeps_requests) == (
        2.0, 3.0, False)
    mine = policy_for(_config(firstTokenSeconds=1.5, longestFreezeSeconds=5), default,
                      keeps=True)
    assert (mine.first_token_s, mine.longest_freeze_s, mine.keeps_requests,
            mine.switch_share) == (1.5, 5.0, True, 0.2)
    for name in ("firstTokenSeconds", "longestFreezeSeconds"):
        with pytest.raises(OpaqueConfigError, match=name):
            _config(**{name: 0})
    with pytest.raises(ValueError, match="switch_share"):
        ModelPolicy(switch_share=1.0)


def test_a_tenant_cannot_buy_gpu_time_with_a_tighter_objective() -> None:
    """A first-token objective tighter than the namespace's allowance would make its
    requests due at once (preempting the holder); a tiny freeze bound would make its own
    holder impossible to preempt. Both are raised to what the admin allows."""
    default = ModelPolicy(first_token_s=2.0, longest_freeze_s=3.0)
    asked = _config(firstTokenSeconds=0.01, longestFreezeSeconds=0.01)
    held = bound(asked, "team-b", default, {"team-*": 0})
    assert (held.config.first_token_seconds, held.config.longest_freeze_seconds) == (
        2.0, 3.0), "a namespace's entry without objectives: the node's defaults"
    assert held.changed["firstTokenSeconds"] == (0.01, 2.0)
    granted = bound(asked, "team-b", default,
                    {"team-b": TenantLimits(first_token_seconds=0.5,
                                            longest_freeze_seconds=1.5)})
    assert (granted.config.first_token_seconds,
            granted.config.longest_freeze_seconds) == (0.5, 1.5)
    loose = bound(_config(firstTokenSeconds=10, longestFreezeSeconds=20), "team-b",
                  default, {"team-*": 0})
    assert not loose.changed, "a looser objective stands"
    open_cluster = bound(asked, "any", default, {})
    assert (open_cluster.config.first_token_seconds,
            open_cluster.config.longest_freeze_seconds) == (OBJECTIVE_FLOOR_S,
                                                            OBJECTIVE_FLOOR_S)
    parsed = TenantLimits.model_validate({"firstTokenSeconds": 1, "longestFreezeSeconds": 2})
    assert (parsed.first_token_seconds, parsed.longest_freeze_seconds) == (1.0, 2.0)


def test_the_node_defaults_are_flags() -> None:
    from controller.lease.settings import load

    plain = load(["--node-name", "n"], {}).model_policy()
    assert (plain.first_token_s, plain.longest_freeze_s, plain.switch_share) == (
        2.0, 3.0, 0.25)
    set_ = load(["--node-name", "n", "--first-token-objective-s", "1.5",
                 "--longest-freeze-s", "4", "--policy-switch-share", "0.1"], {})
    assert (set_.model_policy().first_token_s, set_.model_policy().longest_freeze_s,
            set_.model_policy().switch_share) == (1.5, 4.0, 0.1)
    env = load(["--node-name", "n"], {"ROTA_FIRST_TOKEN_OBJECTIVE_S": "2.5",
                                      "ROTA_LONGEST_FREEZE_S": "6"}).model_policy()
    assert (env.first_token_s, env.longest_freeze_s) == (2.5, 6.0)
