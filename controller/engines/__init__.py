"""Engine adapters: how the lease controller puts engines to sleep, wakes them, and proves
a woken engine answers correctly.

``make_adapter(config, endpoint, session, timeouts)`` picks the adapter a claim's opaque
config names; every adapter satisfies :class:`EngineAdapter` and raises only
:class:`EngineError` subclasses, each with a stable ``reason`` label (see ``errors``).
"""

from __future__ import annotations

from controller.engines.base import (
    EngineAdapter,
    EngineEndpoint,
    SleepOutcome,
    StageAck,
    StepTiming,
    Timeouts,
    WakeOutcome,
)
from controller.engines.errors import (
    EngineError,
    EngineLied,
    EngineProtocolError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    ProbeFailed,
)
from controller.engines.http import HttpAdapter
from controller.engines.probe import ProbeReason, ProbeResult, Usage, run_probe
from controller.engines.registry import make_adapter
from controller.engines.vllm import VllmAdapter
from controller.engines.vllm_omni import VllmOmniAdapter

__all__ = [
    "EngineAdapter",
    "EngineEndpoint",
    "EngineError",
    "EngineLied",
    "EngineProtocolError",
    "EngineRejected",
    "EngineTimeout",
    "EngineUnreachable",
    "HttpAdapter",
    "ProbeFailed",
    "ProbeReason",
    "ProbeResult",
    "SleepOutcome",
    "StageAck",
    "StepTiming",
    "Timeouts",
    "Usage",
    "VllmAdapter",
    "VllmOmniAdapter",
    "WakeOutcome",
    "make_adapter",
    "run_probe",
]
