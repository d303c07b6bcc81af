"""The driver's Prometheus metrics (prefix ``rota_driver_``) and the helpers that observe
them (docs/metrics.md lists them).

Each operation is observed in one place (:func:`observe`), so a duration and its outcome
(``ok`` or a failure reason) are always recorded together.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from prometheus_client import Counter, Gauge, Histogram

from rota.kit.metrics_registry import new_registry, package_version

REGISTRY = new_registry()

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28,
                    2.56, 5.12, 10.24)

OPERATION_SECONDS = Histogram(
    "rota_driver_operation_duration_seconds",
    "Time of one driver operation (prepare or unprepare of one claim, a slice sync, "
    "an NVML read), by outcome.",
    ["operation", "outcome"], buckets=_LATENCY_BUCKETS, registry=REGISTRY,
)
CLAIMS_PREPARED = Gauge(
    "rota_driver_claims_prepared", "Claims prepared on this node (completed ledger entries).",
    registry=REGISTRY,
)
LEDGER_BYTES = Gauge(
    "rota_driver_ledger_bytes", "Size of the ledger file in bytes.", registry=REGISTRY,
)
SLICE_WRITES = Counter(
    "rota_driver_slice_writes_total", "ResourceSlice writes, by verb.", ["verb"],
    registry=REGISTRY,
)
SLICE_SYNCS = Counter(
    "rota_driver_slice_syncs_total", "Reconciliations of the node's ResourceSlices.",
    registry=REGISTRY,
)
NVML_ERRORS = Counter(
    "rota_driver_nvml_errors_total", "Failed NVML calls, by reason.", ["reason"],
    registry=REGISTRY,
)
DEVICE_HEALTHY = Gauge(
    "rota_driver_device_healthy", "1 when the device is healthy, 0 otherwise; gpu_uuid is "
    "its GPU's (DCGM's UUID label).", ["device", "gpu_uuid"], registry=REGISTRY,
)
PUBLISHED_MODE = Gauge(
    "rota_driver_sharing_mode", "1 for the sharing mode in effect on this node.", ["mode"],
    registry=REGISTRY,
)
INFO = Gauge(
    "rota_driver_info", "1, labelled with the driver's version and the sharing mode in "
    "effect on this node.", ["version", "sharing_mode"], registry=REGISTRY,
)


def set_sharing_mode(mode: str, modes: Iterable[str]) -> None:
    """Publish ``mode`` as the one in effect (of all ``modes``) in the mode and info gauges."""
    for each in modes:
        PUBLISHED_MODE.labels(each).set(1 if each == mode else 0)
    INFO.clear()
    INFO.labels(package_version(), mode).set(1)


class Outcome:
    """Set ``reason`` inside an :func:`observe` block to label a failure."""

    def __init__(self) -> None:
        self.reason = "ok"


@contextmanager
def observe(operation: str) -> Iterator[Outcome]:
    """Time the block; label it ``ok``, the reason set on the outcome, or ``error``."""
    outcome = Outcome()
    start = time.perf_counter()
    try:
        yield outcome
    except BaseException:
        if outcome.reason == "ok":
            outcome.reason = "error"
        raise
    finally:
        OPERATION_SECONDS.labels(operation, outcome.reason).observe(time.perf_counter() - start)
