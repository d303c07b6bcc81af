"""The kit's error root: failures of the machinery every process shares.

Each process maps these at its own boundary (the driver's entry point, the lease
controller's and the gateway's) into its answer: a one-line message for a
:class:`ConfigError`, a retry or a refusal for a :class:`KubeError`.
"""

from __future__ import annotations

__all__ = ["ConfigError", "KitError", "KubeConflictError", "KubeError", "KubeNotFoundError"]


class KitError(Exception):
    """Base of every error the kit raises on purpose."""


class ConfigError(KitError):
    """Settings or a fixture file are unusable; the process cannot start."""


class KubeError(KitError):
    """A Kubernetes API call failed."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubeNotFoundError(KubeError):
    """The object does not exist (HTTP 404)."""


class KubeConflictError(KubeError):
    """The write lost a compare-and-swap or the object already exists (HTTP 409)."""
