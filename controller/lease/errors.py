"""The lease controller's one error root.

Every error the lease controller raises on purpose derives from
:class:`LeaseControllerError`, one meaning per class: :class:`~controller.lease.switch.Fenced`
(another writer moved the GPU Lease, or this instance no longer acts for the node),
:class:`~controller.lease.switch.SwitchFailed`, :class:`~controller.lease.switch.SleepUnknown`,
:class:`~controller.lease.device.DeviceError` (the inspection API), every
:class:`~controller.lease.engines.errors.EngineError` (an engine; a pod without an IP is an
engine that cannot be reached, not a fence) and :class:`~controller.lease.node.UnknownModel`.
``tests/test_layering.py`` checks that no other root appears.
"""

from __future__ import annotations

__all__ = ["LeaseControllerError"]


class LeaseControllerError(Exception):
    """Base of every error the lease controller raises on purpose."""
