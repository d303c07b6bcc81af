"""The first-come mode of the switch policy (``--policy-mode first-come``): on-demand
switching in arrival order, llama-swap's behaviour, the baseline the policy benchmark
compares rota against. Each test states what ``rota`` mode decides on the same input, so
the difference is the mode alone."""

from __future__ import annotations

import math

from controller.lease.policy import (
    Action,
    ClaimQueue,
    Decision,
    GpuView,
    ModelPolicy,
    PolicyInput,
    PolicyMode,
    SwitchCost,
    decide,
    policy_for,
)
from controller.lease.settings import load
from rota.api.engine_config import parse_engine_config

FIRST_COME = ModelPolicy(mode=PolicyMode.FIRST_COME)
COSTS = {"a": SwitchCost(sleep_s=0.5, wake_s=0.6, probe_s=0.1),
         "b": SwitchCost(sleep_s=0.05, wake_s=0.05, probe_s=0.05),
         "c": SwitchCost(sleep_s=0.3, wake_s=0.3, probe_s=0.1)}


def _both(**kw: object) -> tuple[Decision, Decision]:
    """(the first-come decision, the rota decision) on the same input."""
    gpu_kw = {k: kw.pop(k) for k in ("holder", "awake_since", "in_flight", "last_request",
                                     "pending") if k in kw}
    gpu = GpuView(now=100.0, **gpu_kw)  # type: ignore[arg-type]
    policies = kw.pop("policies", {})
    queues = kw.pop("queues", ())
    first = decide(PolicyInput(gpu=gpu, queues=queues, policies=policies,  # type: ignore[arg-type]
                               costs=COSTS, default_policy=FIRST_COME))
    rota = decide(PolicyInput(gpu=gpu, queues=queues, policies=policies,  # type: ignore[arg-type]
                              costs=COSTS))
    return first, rota


def test_a_busy_holder_is_switched_away_at_once_without_a_quantum() -> None:
    first, rota = _both(holder="a", awake_since=99.5, in_flight=4,
                        queues=(ClaimQueue("b", 1, 99.9),))
    assert (first.action, first.target, first.rule) == (
        Action.SWITCH, "b", "first_come")
    assert (rota.action, rota.rule) == (Action.STAY, "quantum")


def test_the_oldest_request_is_served_first_whatever_the_queue_lengths() -> None:
    queues = (ClaimQueue("b", 9, 99.0), ClaimQueue("c", 1, 98.0))
    first, rota = _both(holder="a", awake_since=0.0, in_flight=2, queues=queues)
    assert first.target == "c"
    assert rota.target == "b", "rota weighs the longer queue"


def test_priorities_do_not_keep_the_gpu_in_first_come_order() -> None:
    policies = {"a": ModelPolicy(priority=10, mode=PolicyMode.FIRST_COME),
                "c": ModelPolicy(priority=5, mode=PolicyMode.FIRST_COME)}
    first, rota = _both(holder="a", awake_since=0.0, in_flight=2, policies=policies,
                        queues=(ClaimQueue("b", 1, 97.0), ClaimQueue("c", 3, 99.0)))
    assert (first.action, first.target) == (Action.SWITCH, "b")
    assert (rota.action, rota.rule) == (Action.STAY, "stay"), \
        "rota: a busy holder of higher priority keeps the GPU"


def test_an_idle_gpu_wakes_the_first_waiter() -> None:
    first, _ = _both(holder=None, queues=(ClaimQueue("b", 5, 99.0), ClaimQueue("c", 1, 90.0)))
    assert (first.action, first.target, first.rule) == (
        Action.SWITCH, "c", "first_come")


def test_with_nobody_waiting_the_holder_stays_as_in_rota_mode() -> None:
    first, rota = _both(holder="a", in_flight=0, last_request=10.0)
    assert (first.action, first.rule) == (Action.STAY, "keep_alive")
    assert first == rota


def test_the_mode_is_the_nodes_a_claim_cannot_set_it() -> None:
    config = parse_engine_config({"apiVersion": "gpu.rota.dev/v1alpha1", "kind": "EngineConfig",
                                  "model": "m", "awakeMemory": "8Gi", "priority": 3})
    assert policy_for(config, FIRST_COME).mode is PolicyMode.FIRST_COME
    assert policy_for(config, ModelPolicy()).mode is PolicyMode.ROTA


def test_the_setting_reaches_the_nodes_default_policy() -> None:
    assert load(["--node-name", "n"], {}).model_policy().mode is PolicyMode.ROTA
    chosen = load(["--node-name", "n", "--policy-mode", "first-come"], {}).model_policy()
    assert chosen.mode is PolicyMode.FIRST_COME
    assert math.isinf(chosen.keep_alive_s), "llama-swap's ttl 0: awake until someone asks"
    env = load(["--node-name", "n"], {"ROTA_POLICY_MODE": "first-come"}).model_policy()
    assert env.mode is PolicyMode.FIRST_COME
