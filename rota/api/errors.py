"""The contracts' error root: a value that crosses a process boundary breaks its contract.

A claim's configuration is read by the driver (at prepare, where the kubelet shows the
message to the user) and by the lease controller and the gateway (which skip the claim and
say why): one class, one message, whoever reads it.
"""

from __future__ import annotations

__all__ = ["ClaimError", "ContractError", "OpaqueConfigError"]


class ContractError(Exception):
    """Base of every error the contracts raise on purpose."""


class ClaimError(ContractError):
    """A claim cannot be used as it stands. The message is shown to the user as is.

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
