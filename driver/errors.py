"""The driver's error hierarchy.

Every failure the driver reports to a caller is one of these classes. Each boundary maps
them once: the DRA servicer turns a :class:`ClaimError` into that claim's ``error`` string
(the kubelet retries), the Kubernetes facade turns API exceptions into :class:`KubeError`
subclasses, the NVML layer turns ``pynvml.NVMLError`` into :class:`NvmlError`.
"""

from __future__ import annotations


class RotaDriverError(Exception):
    """Base class of every error the driver raises on purpose."""


class ConfigError(RotaDriverError):
    """Settings or a fixture file are unusable; the process cannot start."""


class NvmlError(RotaDriverError):
    """An NVML call failed. ``reason`` is a short stable label for metrics."""

    def __init__(self, message: str, *, reason: str = "nvml") -> None:
        super().__init__(message)
        self.reason = reason


class ClaimError(RotaDriverError):
    """A claim cannot be prepared as it stands. The message is shown to the user as is.

    ``reason`` is a short stable label for metrics (``not_allocated``, ``wrong_pool``, ...).
    ``permanent`` is True when retrying without a change to the claim cannot help.
    """

    def __init__(self, message: str, *, reason: str, permanent: bool = True) -> None:
        super().__init__(message)
        self.reason = reason
        self.permanent = permanent


class OpaqueConfigError(ClaimError):
    """The claim's opaque parameters for this driver are invalid."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="invalid_config")


class BudgetError(ClaimError):
    """The claim's awake budget does not fit next to the other claimants' resident budgets."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="over_budget")


class LedgerError(RotaDriverError):
    """The ledger file is unreadable, corrupt, or its lock could not be taken in time."""


class KubeError(RotaDriverError):
    """A Kubernetes API call failed."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubeNotFoundError(KubeError):
    """The object does not exist (HTTP 404)."""


class KubeConflictError(KubeError):
    """The write lost a compare-and-swap or the object already exists (HTTP 409)."""
