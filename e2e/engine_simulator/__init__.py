"""rota's engine simulator: a stand-in for vLLM with sleep mode, NOT a real inference engine.

It answers vLLM 0.26's development-mode control endpoints (``/sleep``, ``/wake_up``,
``/is_sleeping``, ``/collective_rpc``, ...) and the OpenAI endpoints with vLLM's wire
format and traps (requests held while asleep, abandoned sleeps that fire later, a GPU that
runs out), holds (or pretends to hold) GPU memory, and takes injected faults; behaviours
kinder than vLLM's survive only as named faults. rota's tests, demo and benchmarks run it
in place of vLLM. See README.md in this directory.
"""

from __future__ import annotations

from e2e.engine_simulator.app import create_app, run
from e2e.engine_simulator.settings import Faults, Settings

__all__ = ["Faults", "Settings", "create_app", "run"]
