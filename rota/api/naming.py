"""Names, labels and annotations that the lease controller writes and the gateway reads.

This module is the contract between the two: one coordination.k8s.io/v1 Lease per shared
GPU records who is awake; one Lease per node records which controller instance acts for
that node and where its activation API listens.

GPU Lease (``rota-gpu-<node>-<device>``):

- ``spec.holderIdentity``: ``<namespace>/<claim name>`` of the claimant whose engine is
  awake, or empty when none is. The only record of who may be awake.
- ``spec.leaseTransitions``: the fencing number. Every switch starts by raising it with a
  compare-and-swap write; an instance whose write loses must not touch an engine.
- annotations (:data:`STATE` and the rest below) say what the gateway needs to route:
  the holder's model and endpoint, the switch in progress, the last failure.

Controller Lease (``rota-controller-<node>``): ``holderIdentity`` is the controller
instance; renewed every few seconds; annotation :data:`ACTIVATION_URL`.

Compatibility, so that a rolling upgrade may run two releases side by side:

- readers ignore annotations and labels they do not know (a newer writer may add some),
  and keep them on their next write (:attr:`rota.api.gpu_lease.GpuLease.extra_annotations`);
- a key is never given a new meaning; a new meaning gets a new key;
- a removed key is still read and dropped for one release (never written again), so that
  the first write of the new release removes it: :data:`HOLDER_ENDPOINT` is one;
- a state value a reader does not know is never read as a holder that may be served: it
  is read as :attr:`LeaseState.SWITCHING` (``GpuLease.from_object``), so the gateway takes
  it for a switch under way and the controller reconciles the GPU first, from what the
  device and the engines say.
"""

from __future__ import annotations

import hashlib
import re
from enum import StrEnum

DOMAIN = "gpu.rota.dev"

LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "rota"
LABEL_KIND = f"{DOMAIN}/lease"
KIND_GPU = "gpu"
KIND_CONTROLLER = "controller"
DEFAULT_NAMESPACE = "rota-system"
"""Where rota's Leases live unless an install names another namespace."""
LABEL_NODE = f"{DOMAIN}/node"
LABEL_DEVICE = f"{DOMAIN}/device"
NODE_NAME = f"{DOMAIN}/node-name"
"""Annotation of every Lease a controller writes: its node's full name (the label is hashed
past 63 characters); the chart's admission policy compares it with the token's node."""

STATE = f"{DOMAIN}/state"
"""A :class:`LeaseState`: ``awake``, ``switching``, ``starting``, ``idle`` or ``failed``."""
HOLDER_MODEL = f"{DOMAIN}/holder-model"
HOLDER_CLAIM_UID = f"{DOMAIN}/holder-claim-uid"
HOLDER_ENDPOINT = f"{DOMAIN}/holder-endpoint"
"""No longer written (older controllers put the holder's address here); a GPU Lease says
who holds a GPU, never where to send traffic, and a read drops this annotation."""
TARGET_MODEL = f"{DOMAIN}/target-model"
"""During a switch: the model being woken."""
DRAINING_MODEL = f"{DOMAIN}/draining-model"
"""During a switch: the model being put to sleep; gateways hold its new requests."""
LAST_ERROR = f"{DOMAIN}/last-error"
"""``<reason>: <message>`` of the last failed switch."""
ACTING_CONTROLLER = f"{DOMAIN}/controller"
ACTIVATION_URL = f"{DOMAIN}/activation-url"
INSTANCE = f"{DOMAIN}/instance"
"""On the controller Lease: the process that holds it (a fresh id per process start), so
that a restarted process with the same identity waits for the Lease like anyone else."""
GPU_UUID = f"{DOMAIN}/gpu-uuid"
GANG = f"{DOMAIN}/gang"
"""GPU Lease annotation: the GPUs of the holder (or of the switch's target) when it holds
more than one, comma-separated in GPU order (``gpu-0,gpu-1``): a tensor-parallel engine is
awake only while every one of those GPU Leases names it. Absent for a one-GPU holder."""
AWAKE_WITH = f"{DOMAIN}/awake-with"
"""GPU Lease annotation, only where the admin allows an awake set (``--awake-set``): the
engines awake beside the holder, a JSON list of ``{"claim": "<namespace>/<name>", "uid":
"<claim uid>", "model": "<served model>"}`` in the order they were woken. The holder and
these are the GPU's whole awake set, and their awake budgets fit the GPU together. Absent
(one awake at most) by default. A reader that cannot parse it reads the Lease as
``switching`` (no traffic, reconciled first)."""
START_GRANTED = f"{DOMAIN}/start-granted"
"""GPU Lease annotation: ``<claim uid> <MicroTime>``, the newcomer whose start gate was
given its go, and when; written (compare-and-swap) before the go is handed over, and kept
until that start is settled. An instance that takes over after a grant knows from it that
an engine may be coming up (a real vLLM spends seconds importing before it holds GPU
memory or answers), and wakes nobody beside it until it answers, its container asks the
start gate again, or the start's limit has passed."""

class LeaseState(StrEnum):
    """The :data:`STATE` annotation of a GPU Lease."""

    AWAKE = "awake"
    """The holder serves."""
    SWITCHING = "switching"
    """A switch runs (or was cut short: whoever finds it so reconciles first)."""
    STARTING = "starting"
    """A start-up admission runs: the holder sleeps while a new engine initialises."""
    IDLE = "idle"
    """Nobody is awake."""
    FAILED = "failed"
    """The last switch failed and left nobody awake (``last-error`` says why)."""


# Short names of the states (StrEnum members: they compare equal to the plain strings).
STATE_AWAKE = LeaseState.AWAKE
STATE_SWITCHING = LeaseState.SWITCHING
STATE_STARTING = LeaseState.STARTING
STATE_IDLE = LeaseState.IDLE
STATE_FAILED = LeaseState.FAILED

_MAX_NAME = 253
_MAX_LABEL = 63
_INVALID = re.compile(r"[^a-z0-9.-]")


def _bounded(name: str, limit: int) -> str:
    name = _INVALID.sub("-", name.lower()).strip("-.")
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:10]
    return f"{name[:limit - 11].rstrip('-.')}-{digest}"


def gpu_lease_name(node: str, device: str) -> str:
    """The GPU Lease of one device on one node."""
    return _bounded(f"rota-gpu-{node}-{device}", _MAX_NAME)


def controller_lease_name(node: str) -> str:
    """The Lease whose holder is the controller instance acting for ``node``."""
    return _bounded(f"rota-controller-{node}", _MAX_NAME)


def label_value(value: str) -> str:
    """A label value (<= 63 characters) naming a node or device."""
    return _bounded(value, _MAX_LABEL)


def gpu_lease_selector(node: str) -> str:
    """The label selector of ``node``'s GPU Leases."""
    return f"{LABEL_KIND}={KIND_GPU},{LABEL_NODE}={label_value(node)}"


def claim_ref(namespace: str, name: str) -> str:
    """The holderIdentity of a claimant."""
    return f"{namespace}/{name}"


_SHARE_SUFFIX = re.compile(r"-share-[0-9]+\Z")


def physical_device(device: str) -> str:
    """The GPU (its device name, ``gpu-<i>``) that a device name of rota's pool stands for.

    Every sharing mode publishes a GPU under other names (``partitioned``:
    ``gpu-<i>-share-<k>``), but one physical GPU is one unit of "one engine awake": the
    lease controller keys its workers and GPU Leases, and the gateway its routing, by the
    name this returns. Pure; names of devices rota does not publish come back unchanged.
    """
    return _SHARE_SUFFIX.sub("", device)
