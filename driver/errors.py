"""The driver's error hierarchy.

Every failure the driver reports to a caller is one of these classes, the contracts'
:class:`~rota.api.errors.ClaimError` (a claim that cannot be used as it stands) or the kit's
:class:`~rota.kit.errors.ConfigError` and :class:`~rota.kit.errors.KubeError`. Each
boundary maps them once: the DRA servicer turns a ``ClaimError`` into that claim's
``error`` string (the kubelet retries), the kit's Kubernetes facade turns API exceptions
into ``KubeError`` subclasses, the NVML layer turns ``pynvml.NVMLError`` into
:class:`NvmlError`.
"""

from __future__ import annotations

from rota.api.errors import ClaimError


class RotaDriverError(Exception):
    """Base class of every error the driver raises on purpose."""


class NvmlError(RotaDriverError):
    """An NVML call failed. ``reason`` is a short stable label for metrics."""

    def __init__(self, message: str, *, reason: str = "nvml") -> None:
        super().__init__(message)
        self.reason = reason


class BudgetError(ClaimError, RotaDriverError):
    """The claim's awake budget does not fit next to the other claimants' resident budgets."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="over_budget")


class LedgerError(RotaDriverError):
    """The ledger file is unreadable, corrupt, or its lock could not be taken in time."""
