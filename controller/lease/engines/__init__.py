"""Engine adapters: how the lease controller puts engines to sleep, wakes them, and proves
a woken engine answers correctly.

``make_adapter(config, endpoint, session, timeouts)`` picks the adapter a claim's opaque
config names; every adapter satisfies :class:`EngineAdapter` and raises only
:class:`EngineError` subclasses, each with a stable ``reason`` label (see ``errors``).
"""

from __future__ import annotations

from controller.lease.engines.base import (
    CONTROL_TOKEN_HEADER,
    EngineAdapter,
    EngineEndpoint,
    SleepOutcome,
    SleepState,
    SleepStateKind,
    StageAck,
    StepTiming,
    Timeouts,
    UnfinishedWake,
    WakeOutcome,
)
from controller.lease.engines.errors import (
    EngineDead,
    EngineError,
    EngineLied,
    EngineProtocolError,
    EngineRejected,
    EngineStateUnknown,
    EngineTimeout,
    EngineUnreachable,
    EngineUnsupported,
    ProbeFailed,
)
from controller.lease.engines.http import HttpAdapter
from controller.lease.engines.probe import ProbeMode, ProbeReason, ProbeResult, Usage, run_probe
from controller.lease.engines.registry import make_adapter
from controller.lease.engines.vllm import VllmAdapter
from controller.lease.engines.vllm_omni import VllmOmniAdapter

__all__ = [
    "CONTROL_TOKEN_HEADER",
    "EngineAdapter",
    "EngineDead",
    "EngineEndpoint",
    "EngineError",
    "EngineLied",
    "EngineProtocolError",
    "EngineRejected",
    "EngineStateUnknown",
    "EngineTimeout",
    "EngineUnreachable",
    "EngineUnsupported",
    "HttpAdapter",
    "ProbeFailed",
    "ProbeMode",
    "ProbeReason",
    "ProbeResult",
    "SleepOutcome",
    "SleepState",
    "SleepStateKind",
    "StageAck",
    "StepTiming",
    "Timeouts",
    "UnfinishedWake",
    "Usage",
    "VllmAdapter",
    "VllmOmniAdapter",
    "WakeOutcome",
    "make_adapter",
    "run_probe",
]
