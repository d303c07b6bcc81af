"""Turn a ResourceClaim into a checked, deterministic plan for prepare.

The kubelet sends only a claim's namespace, name and uid; prepare reads the claim from the
API server and this module decides, without side effects, whether rota may prepare it and
with what. The same claim always gives the same :class:`ClaimPlan`, so an idempotent
prepare can recompute the plan and compare it with what the ledger recorded.

Rules, in the order they are checked (each refusal is a :class:`~rota.api.errors.ClaimError`
with the stable ``reason`` shown in brackets):

1. ``metadata.uid`` must be the uid the kubelet asked for; a different uid means the claim
   was deleted and re-created under the same name [``replaced``].
2. A claim being deleted (``metadata.deletionTimestamp``) is not prepared [``deleting``].
3. ``status.allocation`` must be set [``not_allocated``, not permanent: the scheduler may
   still allocate it].
4. At least one allocation result must name this driver [``no_results``]; results of other
   drivers are ignored, a claim may mix drivers. Results with ``adminAccess`` are refused
   [``admin_access``]: rota accounts for every holder of a GPU and has no monitoring mode.
5. Each of our results must be in this node's pool [``wrong_pool``] and name a device this
   driver publishes [``unknown_device``].
6. A device published with ``allowMultipleAllocations`` must come with a ``shareID``, a
   plain device must not [``bad_share_id``]. The same (device, shareID) may not appear twice
   [``duplicate_device``].
7. Consumed capacities must be whole quantities. For a shared device the consumed
   ``memory`` is what the claim holds on the GPU all the time; it must be present, above
   zero and within the device's capacity [``bad_capacity``]. A plain device (exclusive, or
   one fixed partition) is held whole: its resident memory is its published capacity.
8. Opaque configs for this driver are read from ``status.allocation.devices.config``, or
   from ``spec.devices.config`` when the allocation carries none. An entry applies when its
   ``requests`` list is empty or names one of our results' requests (``req`` covers its
   subrequests ``req/sub``). Entries from the claim (``FromClaim``, and every spec entry)
   override entries from the DeviceClass (``FromClass``); within the winning source, more
   than one distinct applicable entry is ambiguous [``invalid_config``]. The entry must
   parse as an :class:`~rota.api.engine_config.EngineConfig` [``invalid_config``].
9. The awake budget on each GPU (``awakeMemory``, never less than the claim's own resident
   memory there) must fit on that GPU at all [``over_budget``].

Budgets are per physical GPU: ``awakeMemory`` is what the engine holds on one GPU while
awake. A claim normally holds one share of one GPU; :meth:`ClaimPlan.resident_bytes_on` and
:meth:`ClaimPlan.awake_bytes_on` give the per-GPU numbers when it holds more.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from driver.errors import BudgetError
from rota.api.claim_config import select_engine_config
from rota.api.engine_config import EngineConfig
from rota.api.errors import ClaimError
from rota.api.quantity import format_bytes, parse_quantity

__all__ = [
    "MEMORY",
    "AllocatedShare",
    "ClaimPlan",
    "PublishedDevice",
    "base_request_name",
    "plan_claim",
]

MEMORY = "memory"
"""The capacity name that carries GPU memory in bytes."""

_SHARE_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]{0,63}")
_SHOWN = 64


@dataclass(frozen=True)
class PublishedDevice:
    """A device this driver publishes in its ResourceSlice, as prepare needs to know it."""

    name: str
    """Device name in the pool (``gpu-0``, or a fixed partition such as ``gpu-0-share-1``)."""
    gpu_uuid: str
    """The physical GPU behind the device."""
    gpu_index: int
    """NVML index of the physical GPU."""
    gpu_memory_bytes: int
    """Total memory of the physical GPU."""
    capacity_memory_bytes: int
    """The device's published ``memory`` capacity: the GPU's total, or a partition's share."""
    shared: bool
    """Published with ``allowMultipleAllocations: true``."""
    gpu_minor: int | None = None
    """Minor number of ``/dev/nvidia<minor>``; None when it equals ``gpu_index``."""


@dataclass(frozen=True)
class AllocatedShare:
    """One allocation result of this driver in a claim: a device, or one share of it."""

    request: str
    """Base request name (a ``req/sub`` subrequest becomes ``req``)."""
    pool: str
    device: str
    share_id: str | None
    gpu_uuid: str
    consumed_memory_bytes: int
    """Memory the claim holds on the GPU through this share, asleep or awake."""
    consumed: tuple[tuple[str, int], ...]
    """Every consumed capacity of the result, by name, sorted; empty for plain devices."""


@dataclass(frozen=True)
class ClaimPlan:
    """What prepare will do for one claim; computed purely from the claim and our devices."""

    uid: str
    namespace: str
    name: str
    shares: tuple[AllocatedShare, ...]
    config: EngineConfig | None
    resident_bytes: int
    """Sum of the memory the claim's shares hold all the time."""
    awake_bytes: int
    """The awake budget per GPU: ``awakeMemory`` of the claim's config; without a config,
    its resident memory (on the GPU where it holds most, when it holds several)."""

    @property
    def gpu_uuids(self) -> tuple[str, ...]:
        """The physical GPUs the claim touches, sorted."""
        return tuple(sorted({share.gpu_uuid for share in self.shares}))

    @property
    def exclusive(self) -> bool:
        """True when the claim holds a device whole (no shareID) rather than a share of it."""
        return any(share.share_id is None for share in self.shares)

    def resident_bytes_on(self, gpu_uuid: str) -> int:
        """Memory the claim holds on one GPU all the time."""
        return sum(s.consumed_memory_bytes for s in self.shares if s.gpu_uuid == gpu_uuid)

    def awake_bytes_on(self, gpu_uuid: str) -> int:
        """Memory the claim needs on one GPU while awake: its awake budget, at least resident."""
        resident = self.resident_bytes_on(gpu_uuid)
        if self.config is None:
            return resident
        return max(self.config.awake_memory, resident)


def base_request_name(request: str) -> str:
    """The request a result belongs to: ``req/sub`` (from firstAvailable) becomes ``req``."""
    return request.split("/", 1)[0]


def _shown(value: object) -> str:
    """A value from the claim as it may appear in a message: quoted and cut short."""
    text = str(value)
    return repr(text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "...")


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _sequence(value: object) -> Sequence[Any]:
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return value
    return ()


@dataclass(frozen=True)
class _Context:
    uid: str
    namespace: str
    name: str
    driver: str
    pool: str

    @property
    def ref(self) -> str:
        return f"{self.namespace}/{self.name}"


def plan_claim(
    claim: Mapping[str, Any],
    *,
    expected_uid: str,
    namespace: str,
    name: str,
    driver: str,
    pool: str,
    devices: Mapping[str, PublishedDevice],
) -> ClaimPlan:
    """Check a ResourceClaim (resource.k8s.io/v1 JSON) and compute its prepare plan.

    Args:
        claim: the claim as the API server returned it.
        expected_uid: the uid the kubelet asked to prepare.
        namespace: the claim's namespace, as the kubelet named it.
        name: the claim's name, as the kubelet named it.
        driver: this driver's name.
        pool: this node's pool name.
        devices: the devices this driver publishes in that pool, by name.

    Raises:
        ClaimError: the claim cannot be prepared; see the module docstring for the reasons.
    """
    ctx = _Context(expected_uid, namespace, name, driver, pool)
    metadata = _mapping(claim.get("metadata"))
    uid = metadata.get("uid")
    if uid != expected_uid:
        raise ClaimError(
            f"claim {ctx.ref} has uid {_shown(uid)}, not {_shown(expected_uid)}: it was deleted "
            "and created again under the same name; the pod must be re-created",
            reason="replaced",
        )
    if metadata.get("deletionTimestamp"):
        raise ClaimError(
            f"claim {ctx.ref} is being deleted; it will not be prepared",
            reason="deleting",
        )
    status = _mapping(claim.get("status"))
    allocation = status.get("allocation")
    if not isinstance(allocation, Mapping):
        raise ClaimError(
            f"claim {ctx.ref} is not allocated yet; the scheduler has to allocate it first",
            reason="not_allocated",
            permanent=False,
        )
    allocated = _mapping(allocation.get("devices"))
    ours = [r for r in _sequence(allocated.get("results")) if _mapping(r).get("driver") == driver]
    if not ours:
        raise ClaimError(
            f"claim {ctx.ref} has no device allocated by driver {driver}",
            reason="no_results",
        )
    shares = tuple(_share(ctx, _mapping(result), devices) for result in ours)
    seen: set[tuple[str, str | None]] = set()
    for share in shares:
        key = (share.device, share.share_id)
        if key in seen:
            which = share.device if share.share_id is None else f"{share.device}/{share.share_id}"
            raise ClaimError(
                f"claim {ctx.ref} is allocated {which} more than once",
                reason="duplicate_device",
            )
        seen.add(key)
    full_requests = [str(_mapping(result).get("request", "")) for result in ours]
    config = select_engine_config(claim, allocated, full_requests, driver=driver,
                                  ref=ctx.ref)
    resident = sum(share.consumed_memory_bytes for share in shares)
    per_gpu = {share.gpu_uuid: 0 for share in shares}
    for share in shares:
        per_gpu[share.gpu_uuid] += share.consumed_memory_bytes
    plan = ClaimPlan(
        uid=expected_uid,
        namespace=namespace,
        name=name,
        shares=shares,
        config=config,
        resident_bytes=resident,
        awake_bytes=config.awake_memory if config is not None else max(per_gpu.values()),
    )
    _check_awake_within_gpu(ctx, plan, devices)
    return plan


def _share(
    ctx: _Context, result: Mapping[str, Any], devices: Mapping[str, PublishedDevice]
) -> AllocatedShare:
    request = str(result.get("request", ""))
    result_pool = result.get("pool")
    device_name = result.get("device")
    if result.get("adminAccess") is True:
        raise ClaimError(
            f"claim {ctx.ref} requests admin access to {_shown(device_name)}; driver "
            f"{ctx.driver} does not support adminAccess",
            reason="admin_access",
        )
    if result_pool != ctx.pool:
        raise ClaimError(
            f"claim {ctx.ref} is allocated {_shown(device_name)} in pool {_shown(result_pool)}, "
            f"but this node's pool is {ctx.pool}; the pod was bound to the wrong node",
            reason="wrong_pool",
        )
    device = devices.get(device_name) if isinstance(device_name, str) else None
    if device is None:
        names = sorted(devices)
        known = ", ".join(names[:8]) + (", ..." if len(names) > 8 else "") if names else "none"
        raise ClaimError(
            f"claim {ctx.ref} is allocated device {_shown(device_name)}, which pool {ctx.pool} "
            f"does not publish (devices: {known}); delete and re-create the claim",
            reason="unknown_device",
        )
    share_id = result.get("shareID")
    if device.shared:
        if not isinstance(share_id, str) or not _SHARE_ID.fullmatch(share_id):
            problem = "has no shareID" if share_id in (None, "") else "has a malformed shareID"
            raise ClaimError(
                f"claim {ctx.ref} is allocated shared device {device.name} but the result "
                f"{problem}; the scheduler must run with DRAConsumableCapacity enabled",
                reason="bad_share_id",
            )
    elif share_id is not None:
        raise ClaimError(
            f"claim {ctx.ref} is allocated device {device.name} with shareID "
            f"{_shown(share_id)}, but that device is not shared; delete and re-create the claim",
            reason="bad_share_id",
        )
    consumed = _consumed(ctx, device, result.get("consumedCapacity"))
    if device.shared:
        memory = dict(consumed).get(MEMORY)
        if memory is None or memory <= 0:
            raise ClaimError(
                f"claim {ctx.ref} holds a share of {device.name} without consumed memory; "
                f"request it with capacity.requests.{MEMORY} (the engine's footprint asleep)",
                reason="bad_capacity",
            )
        if memory > device.capacity_memory_bytes:
            raise ClaimError(
                f"claim {ctx.ref} consumes {format_bytes(memory)} of {device.name}, more than "
                f"its {format_bytes(device.capacity_memory_bytes)}",
                reason="bad_capacity",
            )
    else:
        memory = device.capacity_memory_bytes
    return AllocatedShare(
        request=base_request_name(request),
        pool=ctx.pool,
        device=device.name,
        share_id=share_id if device.shared else None,
        gpu_uuid=device.gpu_uuid,
        consumed_memory_bytes=memory,
        consumed=consumed,
    )


def _consumed(ctx: _Context, device: PublishedDevice, raw: object) -> tuple[tuple[str, int], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, Mapping):
        raise ClaimError(
            f"claim {ctx.ref}: consumedCapacity of {device.name} is not a map",
            reason="bad_capacity",
        )
    values: dict[str, int] = {}
    prefix = f"{ctx.driver}/"
    for key, quantity in raw.items():
        name = str(key).removeprefix(prefix)
        try:
            value = parse_quantity(quantity)
        except ValueError as exc:
            raise ClaimError(
                f"claim {ctx.ref}: consumed capacity {_shown(key)} of {device.name}: {exc}",
                reason="bad_capacity",
            ) from None
        if name in values and values[name] != value:
            raise ClaimError(
                f"claim {ctx.ref}: consumed capacity {_shown(name)} of {device.name} is given "
                "twice with different values",
                reason="bad_capacity",
            )
        values[name] = value
    return tuple(sorted(values.items()))


def _check_awake_within_gpu(
    ctx: _Context, plan: ClaimPlan, devices: Mapping[str, PublishedDevice]
) -> None:
    gpu_memory = {d.gpu_uuid: d.gpu_memory_bytes for d in devices.values()}
    for gpu_uuid in plan.gpu_uuids:
        awake = plan.awake_bytes_on(gpu_uuid)
        total = gpu_memory[gpu_uuid]
        if awake > total:
            raise BudgetError(
                f"claim {ctx.ref} needs {format_bytes(awake)} awake, but GPU {gpu_uuid} has "
                f"only {format_bytes(total)}: {format_bytes(awake - total)} short"
            )
