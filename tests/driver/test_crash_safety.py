"""The driver killed with SIGKILL at random moments of a stream of prepares and
unprepares (some cut off by their gRPC deadline, as the kubelet's 45 s deadline does), and
restarted each time: the ledger agrees with every answer it gave, no CDI spec is left for
an unprepared claim, no GPU is over-committed. Then the same on a disk that fails (ENOSPC,
EIO at random calls) and crashes, with calls cancelled at random points: a shorter run of
``python -m e2e.campaigns.driver_crash``."""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes import client

from e2e.campaigns.driver_crash import run_campaign
from e2e.harness.local_node import GpuNode
from e2e.harness.objects import claim, create_claim, engine_config, engine_pod, read_claim
from e2e.harness.waiting import eventually
from rota.kit.grpc_services import method_path
from rota.pb.dra.v1 import api_pb2 as dra

pytestmark = [pytest.mark.cluster, pytest.mark.driver, pytest.mark.slow]

KILLS = 200
CLAIMS = 8
GIB = 1024**3
SERVICE = dra.DESCRIPTOR.services_by_name["DRAPlugin"]


@dataclass
class ClaimHistory:
    """What the driver answered about one claim, and whether a call is unresolved."""

    ref: dra.Claim
    answered: str = "unprepared"  # the last answer: "prepared" | "unprepared" | "refused"
    uncertain: bool = False  # a call was sent after that answer and got none
    cut: int = 0  # calls cut off by their deadline
    errors: list[str] = field(default_factory=list)


def _stub(channel: grpc.Channel, method: str, response: Any
          ) -> grpc.UnaryUnaryMultiCallable[Any, Any]:
    return channel.unary_unary(method_path(SERVICE, method),
                               request_serializer=lambda m: m.SerializeToString(),
                               response_deserializer=response.FromString)


def _drive(node: GpuNode, history: dict[str, ClaimHistory], rng: random.Random,
           stop: threading.Event) -> int:
    """Send random prepare/unprepare batches until the driver dies or ``stop``. Some calls
    get a deadline of a few milliseconds, as a slow node gets the kubelet's 45 s one: the
    claims of a call cut off stay uncertain until the next answered call of theirs."""
    calls = 0
    with grpc.insecure_channel(f"unix://{node.dirs.dra_socket}") as channel:
        prepare = _stub(channel, "NodePrepareResources", dra.NodePrepareResourcesResponse)
        unprepare = _stub(channel, "NodeUnprepareResources", dra.NodeUnprepareResourcesResponse)
        while not stop.is_set():
            batch = rng.sample(sorted(history), rng.randint(1, 4))
            verb = rng.choice(("prepare", "unprepare"))
            timeout = rng.uniform(0.001, 0.02) if rng.random() < 0.3 else 10.0
            for uid in batch:
                history[uid].uncertain = True
            refs = [history[uid].ref for uid in batch]
            settled = set(batch)
            try:
                if verb == "prepare":
                    answer = prepare(dra.NodePrepareResourcesRequest(claims=refs),
                                     timeout=timeout)
                    for uid in batch:
                        entry = answer.claims[uid]
                        history[uid].answered = "refused" if entry.error else "prepared"
                        if entry.error:
                            history[uid].errors.append(entry.error)
                            # A refusal leaves the claim as it was only if it was not
                            # prepared; a prepared claim is answered from the ledger.
                else:
                    answer = unprepare(dra.NodeUnprepareResourcesRequest(claims=refs),
                                       timeout=timeout)
                    for uid in batch:
                        error = answer.claims[uid].error
                        if error:  # only a call that got the lock after its deadline
                            assert "deadline" in error, error
                            history[uid].cut += 1
                            settled.discard(uid)
                        else:
                            history[uid].answered = "unprepared"
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    for uid in batch:
                        history[uid].cut += 1
                    continue  # outcome unknown; the driver goes on
                return calls  # the driver died under the call: outcome unknown
            for uid in settled:
                history[uid].uncertain = False
            calls += 1
    return calls


def _check(node: GpuNode, history: dict[str, ClaimHistory], gpu_total: int) -> None:
    ledger = json.loads(node.dirs.ledger.read_text()) if node.dirs.ledger.exists() else None
    claims = ledger["data"]["claims"] if ledger else {}
    specs = set(node.cdi_specs())
    for uid, h in history.items():
        record = claims.get(uid)
        completed = record is not None and record["state"] == "PrepareCompleted"
        if h.uncertain:
            continue
        if h.answered == "prepared":
            assert completed, f"claim {uid} was answered prepared but the ledger lost it"
            assert uid in specs, f"claim {uid} was answered prepared but has no CDI spec"
        elif h.answered == "unprepared":
            assert record is None, f"claim {uid} was answered unprepared but is in the ledger"
    resident = sum(r["residentBytes"] for r in claims.values())
    assert resident <= gpu_total, f"resident budgets {resident} exceed the GPU {gpu_total}"
    for record in claims.values():
        others = resident - record["residentBytes"]
        assert record["awakeBytes"] + others <= gpu_total, (
            f"claim {record['uid']} could not wake: {record['awakeBytes']} + {others}")


def _check_after_restore(node: GpuNode) -> None:
    ledger = json.loads(node.dirs.ledger.read_text()) if node.dirs.ledger.exists() else None
    claims = ledger["data"]["claims"] if ledger else {}
    assert all(r["state"] == "PrepareCompleted" for r in claims.values()), claims
    completed = set(claims)
    assert set(node.cdi_specs()) <= completed, "CDI spec left for an unprepared claim"


def _wait_serving(node: GpuNode) -> None:
    def serving() -> bool:
        assert node.driver is not None
        assert node.driver.alive(), node.driver.log_tail()
        with grpc.insecure_channel(f"unix://{node.dirs.dra_socket}") as channel:
            _stub(channel, "NodePrepareResources", dra.NodePrepareResourcesResponse)(
                dra.NodePrepareResourcesRequest(), timeout=2)
        return True

    eventually(serving, timeout=30, interval=0.02, max_interval=0.05,
               what="driver serving after restart")


@pytest.mark.sampled
def test_sigkill_at_random_moments_never_corrupts_state(
        gpu_node: GpuNode, kube_api: client.ApiClient, namespace: str) -> None:
    rng = random.Random(20261129)
    core = client.CoreV1Api(kube_api)
    # Resident 12Gi each; awake budgets large enough that not every claim fits at once,
    # so the budget checks refuse some prepares along the way.
    for i in range(CLAIMS):
        awake = f"{70 + 10 * (i % 4)}Gi"
        create_claim(kube_api, namespace, claim(f"c{i}", memory="12Gi",
                                                config=engine_config(model=f"m{i}", awake=awake)))
        core.create_namespaced_pod(namespace, engine_pod(f"p{i}", node=gpu_node.name,
                                                         claim_name=f"c{i}"))
    eventually(lambda: all(read_claim(kube_api, namespace, f"c{i}").get("status", {})
                           .get("allocation") for i in range(CLAIMS)),
               timeout=60, what="claims allocated")
    history = {}
    for i in range(CLAIMS):
        meta = read_claim(kube_api, namespace, f"c{i}")["metadata"]
        history[meta["uid"]] = ClaimHistory(dra.Claim(namespace=namespace, uid=meta["uid"],
                                                      name=meta["name"]))
    gpu_total = 150754820096

    total_calls = 0
    for kill in range(KILLS):
        if kill:
            gpu_node.start_driver(wait=False)
        _wait_serving(gpu_node)
        _check_after_restore(gpu_node)
        stop = threading.Event()
        delay = rng.uniform(0.0, 0.12)
        killer = threading.Timer(delay, gpu_node.kill_driver)
        killer.start()
        try:
            total_calls += _drive(gpu_node, history, rng, stop)
        finally:
            stop.set()
            killer.join()
        _check(gpu_node, history, gpu_total)
    gpu_node.start_driver(wait=False)
    _wait_serving(gpu_node)
    _check_after_restore(gpu_node)
    assert total_calls > KILLS // 10, f"only {total_calls} calls answered over {KILLS} kills"
    assert sum(h.cut for h in history.values()), "no call was ever cut off by its deadline"
    # Budget refusals must have happened, and each states the numbers.
    refusals = [e for h in history.values() for e in h.errors]
    assert refusals, "the stream never hit the awake-budget check"
    assert all("GiB" in e or "deadline" in e for e in refusals), refusals[:3]


CAMPAIGN_ROUNDS = 150


async def test_io_errors_cancellations_and_crashes_never_corrupt_state(
        kube_api: client.ApiClient, namespace: str, tmp_path: Path) -> None:
    report = await run_campaign(kube_api, namespace, tmp_path, rounds=CAMPAIGN_ROUNDS,
                                seed=20261201)
    summary = "\n".join(report.lines())
    assert report.rounds == CAMPAIGN_ROUNDS
    injected = [report.faults, report.crashes, report.lock_holds,
                *(report.calls[k] for k in ("prepare cancelled", "unprepare cancelled",
                                            "prepare ok", "prepare error"))]
    assert all(injected), summary  # every kind of trouble happened
    assert report.inconsistencies == [], summary
    assert report.overcommits == [], summary
    assert report.leaked == [], summary
