"""ResourceClaim validation into a prepare plan: what is accepted, and every refusal."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from driver.claims import ClaimPlan, PublishedDevice, base_request_name, plan_claim
from driver.errors import BudgetError
from rota.api.errors import ClaimError, OpaqueConfigError

DRIVER = "gpu.rota.dev"
POOL = "node-a"
UID = "0b6f3c1e-6a55-4d1e-9a53-1c2f2f7f0a01"
SHARE = "6c1b8d0e-54a1-4f07-9e6b-5a0d3e1f2a11"
SHARE_2 = "7d2c9e1f-65b2-4018-8f7c-6b1e4f2a3b22"
GIB = 2**30
H200 = 143771 * 2**20

DEVICES = {
    d.name: d
    for d in (
        PublishedDevice("gpu-0", "GPU-aaa", 0, H200, H200, shared=True),
        PublishedDevice("gpu-1", "GPU-bbb", 1, 80 * GIB, 80 * GIB, shared=False),
        PublishedDevice("gpu-2-share-0", "GPU-ccc", 2, 80 * GIB, 40 * GIB, shared=False),
        PublishedDevice("gpu-2-share-1", "GPU-ccc", 2, 80 * GIB, 40 * GIB, shared=False),
        PublishedDevice("gpu-3", "GPU-ddd", 3, H200, H200, shared=True),
    )
}


def engine(**fields: Any) -> dict[str, Any]:
    parameters: dict[str, Any] = {
        "apiVersion": "gpu.rota.dev/v1alpha1",
        "kind": "EngineConfig",
        "model": "llama",
        "awakeMemory": "60Gi",
    }
    parameters.update(fields)
    return parameters


def config_entry(
    parameters: object,
    *,
    source: str | None = "FromClaim",
    requests: list[str] | None = None,
    driver: str = DRIVER,
) -> dict[str, Any]:
    entry: dict[str, Any] = {"opaque": {"driver": driver, "parameters": parameters}}
    if source is not None:
        entry["source"] = source
    if requests is not None:
        entry["requests"] = requests
    return entry


def result(
    device: str = "gpu-0",
    *,
    request: str = "engine",
    share_id: str | None = SHARE,
    memory: str | int | None = "2Gi",
    driver: str = DRIVER,
    pool: str = POOL,
    **extra: Any,
) -> dict[str, Any]:
    entry: dict[str, Any] = {"request": request, "driver": driver, "pool": pool, "device": device}
    if share_id is not None:
        entry["shareID"] = share_id
    if memory is not None:
        entry["consumedCapacity"] = {"memory": memory, "engines": "1"}
    entry.update(extra)
    return entry


def exclusive(device: str = "gpu-1", **fields: Any) -> dict[str, Any]:
    return result(device, share_id=None, memory=None, **fields)


def claim(
    *results: dict[str, Any],
    status_config: list[dict[str, Any]] | None = None,
    spec_config: list[dict[str, Any]] | None = None,
    uid: str = UID,
    allocated: bool = True,
    deleting: bool = False,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "llama", "namespace": "team-a", "uid": uid},
        "spec": {"devices": {"requests": [{"name": "engine"}]}},
        "status": {},
    }
    if deleting:
        body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    if spec_config is not None:
        body["spec"]["devices"]["config"] = spec_config
    if allocated:
        devices: dict[str, Any] = {"results": list(results or [result()])}
        if status_config is not None:
            devices["config"] = status_config
        body["status"]["allocation"] = {"devices": devices}
    return body


def plan(body: dict[str, Any]) -> ClaimPlan:
    return plan_claim(
        body,
        expected_uid=UID,
        namespace="team-a",
        name="llama",
        driver=DRIVER,
        pool=POOL,
        devices=DEVICES,
    )


def test_shared_claim_with_engine_config() -> None:
    got = plan(claim(result(), status_config=[config_entry(engine())]))
    assert (got.uid, got.namespace, got.name) == (UID, "team-a", "llama")
    assert len(got.shares) == 1
    share = got.shares[0]
    assert share.request == "engine"
    assert share.pool == POOL
    assert share.device == "gpu-0"
    assert share.share_id == SHARE
    assert share.gpu_uuid == "GPU-aaa"
    assert share.consumed_memory_bytes == 2 * GIB
    assert share.consumed == (("engines", 1), ("memory", 2 * GIB))
    assert got.resident_bytes == 2 * GIB
    assert got.awake_bytes == 60 * GIB
    assert got.config is not None
    assert got.config.model == "llama"
    assert got.gpu_uuids == ("GPU-aaa",)
    assert not got.exclusive


@pytest.mark.parametrize(
    ("results", "resident", "awake", "gpus"),
    [
        ((exclusive("gpu-1"),), 80 * GIB, 80 * GIB, ("GPU-bbb",)),
        ((exclusive("gpu-2-share-1"),), 40 * GIB, 40 * GIB, ("GPU-ccc",)),
        (
            (exclusive("gpu-2-share-0"), exclusive("gpu-2-share-1")),
            80 * GIB,
            80 * GIB,
            ("GPU-ccc",),
        ),
        (
            (exclusive("gpu-2-share-0"), exclusive("gpu-1")),
            120 * GIB,
            80 * GIB,  # per GPU: the larger of the two
            ("GPU-bbb", "GPU-ccc"),
        ),
    ],
)
def test_plain_devices_are_held_whole(
    results: tuple[dict[str, Any], ...], resident: int, awake: int, gpus: tuple[str, ...]
) -> None:
    got = plan(claim(*results))
    assert got.exclusive
    assert got.config is None
    assert got.resident_bytes == resident
    assert got.awake_bytes == awake
    assert got.gpu_uuids == gpus
    assert all(share.share_id is None and share.consumed == () for share in got.shares)


def test_consumed_capacity_of_a_plain_device_is_recorded_but_not_its_resident() -> None:
    got = plan(claim(exclusive("gpu-1", consumedCapacity={"memory": "1Gi"})))
    assert got.shares[0].consumed == (("memory", GIB),)
    assert got.resident_bytes == 80 * GIB


def test_per_gpu_budgets_of_a_claim_on_two_gpus() -> None:
    body = claim(
        result("gpu-0", memory="2Gi"),
        result("gpu-3", memory="3Gi", share_id=SHARE_2),
        status_config=[config_entry(engine(awakeMemory="2500Mi"))],
    )
    got = plan(body)
    assert got.gpu_uuids == ("GPU-aaa", "GPU-ddd")
    assert got.resident_bytes == 5 * GIB
    assert got.resident_bytes_on("GPU-aaa") == 2 * GIB
    assert got.resident_bytes_on("GPU-ddd") == 3 * GIB
    assert got.resident_bytes_on("GPU-zzz") == 0
    assert got.awake_bytes_on("GPU-aaa") == 2500 * 2**20
    assert got.awake_bytes_on("GPU-ddd") == 3 * GIB  # never below its resident


def test_two_shares_of_one_device() -> None:
    got = plan(claim(result(), result(share_id=SHARE_2, memory="3Gi")))
    assert [s.share_id for s in got.shares] == [SHARE, SHARE_2]
    assert got.resident_bytes_on("GPU-aaa") == 5 * GIB


@pytest.mark.parametrize(
    ("request_name", "base"), [("engine", "engine"), ("engine/big", "engine"), ("a/b/c", "a")]
)
def test_subrequest_suffix_is_stripped(request_name: str, base: str) -> None:
    assert base_request_name(request_name) == base
    assert plan(claim(result(request=request_name))).shares[0].request == base


def test_results_of_other_drivers_are_ignored() -> None:
    other = result("nic-0", driver="net.example.com", pool="elsewhere", share_id=None)
    got = plan(claim(other, result()))
    assert [s.device for s in got.shares] == ["gpu-0"]


def test_capacity_names_may_carry_the_driver_domain() -> None:
    got = plan(claim(result(memory=None, consumedCapacity={"gpu.rota.dev/memory": "4Gi"})))
    assert got.resident_bytes == 4 * GIB


def test_plan_is_deterministic() -> None:
    body = claim(result(), result("gpu-3", share_id=SHARE_2), spec_config=[config_entry(engine())])
    assert plan(body) == plan(copy.deepcopy(body))


@pytest.mark.parametrize(
    ("status_config", "spec_config", "model"),
    [
        ([], [], None),
        (None, [config_entry(engine(model="from-spec"), source=None)], "from-spec"),
        ([], [config_entry(engine(model="from-spec"), source=None)], "from-spec"),
        (
            [config_entry(engine(model="status"))],
            [config_entry(engine(model="spec"), source=None)],
            "status",
        ),
        ([config_entry(engine(model="class"), source="FromClass")], None, "class"),
        (
            [
                config_entry(engine(model="class"), source="FromClass"),
                config_entry(engine(model="claim"), source="FromClaim"),
            ],
            None,
            "claim",
        ),
        (
            [
                config_entry(engine(model="claim"), source="FromClaim"),
                config_entry(engine(model="class"), source="FromClass"),
            ],
            None,
            "claim",
        ),
        ([config_entry(engine(model="mine"), requests=["engine"])], None, "mine"),
        ([config_entry(engine(), requests=["other"])], None, None),
        ([config_entry(engine(model="x"), requests=["other", "engine"])], None, "x"),
        ([config_entry(engine(), driver="gpu.nvidia.com")], None, None),
        ([config_entry({"anything": 1}, driver="gpu.nvidia.com")], None, None),
        ([config_entry(engine(model="same")), config_entry(engine(model="same"))], None, "same"),
    ],
)
def test_config_selection(
    status_config: list[dict[str, Any]] | None,
    spec_config: list[dict[str, Any]] | None,
    model: str | None,
) -> None:
    got = plan(claim(result(), status_config=status_config, spec_config=spec_config))
    assert (got.config.model if got.config else None) == model


@pytest.mark.parametrize(
    ("request_name", "config_requests", "applies"),
    [
        ("engine/big", ["engine"], True),
        ("engine/big", ["engine/big"], True),
        ("engine/big", ["engine/small"], False),
        ("engine", ["engine/big"], False),
        ("engines", ["engine"], False),
    ],
)
def test_config_requests_match_subrequests(
    request_name: str, config_requests: list[str], applies: bool
) -> None:
    body = claim(
        result(request=request_name),
        status_config=[config_entry(engine(), requests=config_requests)],
    )
    assert (plan(body).config is not None) is applies


def test_without_config_awake_is_resident() -> None:
    got = plan(claim(result(memory="7Gi")))
    assert got.config is None
    assert got.awake_bytes == got.resident_bytes == 7 * GIB


def reason_of(body: dict[str, Any], **overrides: Any) -> ClaimError:
    kwargs: dict[str, Any] = {
        "expected_uid": UID,
        "namespace": "team-a",
        "name": "llama",
        "driver": DRIVER,
        "pool": POOL,
        "devices": DEVICES,
    }
    kwargs.update(overrides)
    with pytest.raises(ClaimError) as caught:
        plan_claim(body, **kwargs)
    return caught.value


@pytest.mark.parametrize(
    ("body", "reason", "fragment"),
    [
        (claim(uid="ffffffff-0000-0000-0000-000000000000"), "replaced", "created again"),
        (claim(deleting=True), "deleting", "being deleted"),
        (claim(allocated=False), "not_allocated", "not allocated yet"),
        (
            claim(result(driver="net.example.com", share_id=None)),
            "no_results",
            "no device allocated by driver gpu.rota.dev",
        ),
        (claim(result(pool="node-b")), "wrong_pool", "pool 'node-b', but this node's pool"),
        (claim(result("gpu-9")), "unknown_device", "device 'gpu-9', which pool node-a does not"),
        (claim(result(share_id=None)), "bad_share_id", "has no shareID"),
        (claim(result(share_id="")), "bad_share_id", "has no shareID"),
        (claim(result(share_id="../../etc")), "bad_share_id", "malformed shareID"),
        (claim(result(share_id=7)), "bad_share_id", "malformed shareID"),  # type: ignore[arg-type]
        (claim(exclusive("gpu-1", shareID=SHARE)), "bad_share_id", "not shared"),
        (claim(result(memory=None)), "bad_capacity", "without consumed memory"),
        (claim(result(memory="0")), "bad_capacity", "without consumed memory"),
        (claim(result(memory="141Gi")), "bad_capacity", "more than its 140.4 GiB"),
        (claim(result(memory="lots")), "bad_capacity", "invalid quantity 'lots'"),
        (claim(result(memory="-1Gi")), "bad_capacity", "must not be negative"),
        (claim(result(consumedCapacity=["memory"])), "bad_capacity", "not a map"),
        (
            claim(result(consumedCapacity={"memory": "1Gi", "gpu.rota.dev/memory": "2Gi"})),
            "bad_capacity",
            "given twice",
        ),
        (claim(result(), result()), "duplicate_device", f"gpu-0/{SHARE} more than once"),
        (claim(exclusive(), exclusive()), "duplicate_device", "gpu-1 more than once"),
        (claim(result(adminAccess=True)), "admin_access", "adminAccess"),
        (
            claim(
                result(),
                status_config=[
                    config_entry(engine(model="a")),
                    config_entry(engine(model="b"), requests=["engine"]),
                ],
            ),
            "invalid_config",
            "2 different opaque configs",
        ),
        (
            claim(
                result(),
                status_config=[
                    config_entry(engine(model="a"), source="FromClass"),
                    config_entry(engine(model="b"), source="FromClass"),
                ],
            ),
            "invalid_config",
            "2 different opaque configs",
        ),
        (
            claim(result(), spec_config=[config_entry(engine(sleepLevel=3), source=None)]),
            "invalid_config",
            "sleepLevel",
        ),
        (
            claim(result(), status_config=[config_entry(engine(awakeMemory="141Gi"))]),
            "over_budget",
            "needs 141.0 GiB awake, but GPU GPU-aaa has only 140.4 GiB: 613.0 MiB short",
        ),
        (
            claim(
                exclusive("gpu-2-share-0"),
                status_config=[config_entry(engine(awakeMemory="81Gi"))],
            ),
            "over_budget",
            "needs 81.0 GiB awake, but GPU GPU-ccc has only 80.0 GiB",
        ),
    ],
)
def test_refusals(body: dict[str, Any], reason: str, fragment: str) -> None:
    error = reason_of(body)
    assert error.reason == reason
    assert fragment in str(error)
    assert error.permanent is (reason != "not_allocated")
    if reason == "invalid_config" and "opaque configs" not in str(error):
        assert isinstance(error, OpaqueConfigError)
    if reason == "over_budget":
        assert isinstance(error, BudgetError)


def test_messages_name_the_claim() -> None:
    error = reason_of(claim(result(pool="node-b")))
    assert "team-a/llama" in str(error)


def test_long_user_values_are_cut_in_messages() -> None:
    error = reason_of(claim(result("g" * 5000)))
    assert error.reason == "unknown_device"
    assert "g" * 100 not in str(error)


def test_pool_is_checked_against_the_given_pool() -> None:
    error = reason_of(claim(result()), pool="node-b")
    assert error.reason == "wrong_pool"
