"""The adapter for vLLM's OpenAI server with sleep mode, on vLLM 0.26's exact wire behaviour.

vLLM serves its sleep controls only with ``VLLM_SERVER_DEV_MODE=1`` (and sleep needs
``--enable-sleep-mode``). These routes are **never authenticated** by vLLM, ``--api-key``
or not: anyone who reaches the engine's port can put it to sleep. Only the network (the
engines' NetworkPolicy) or rota's engine guard protects them; the control token this
adapter sends is checked by the guard alone. Its traps, and what this adapter does:

- ``POST /sleep`` reads the query only: a JSON body or a misspelt parameter is ignored and
  the engine sleeps at level 1 with ``mode=abort``. The adapter sends
  ``/sleep?level=N&mode=wait`` and no body. (The controller drains at the gateway first;
  ``wait`` is the second line of defence: ``abort`` races in-flight CUDA work.)
- ``/sleep`` and ``/wake_up`` answer 200 with an empty body, even from an engine that is
  about to crash: every sleep and wake is confirmed with ``GET /is_sleeping`` and, where
  exported, ``vllm:engine_sleep_state``.
- A ``/sleep`` whose client gives up is **not** cancelled: vLLM carries it out when the
  engine next goes idle, even after a later wake, and the next request then kills the
  engine core. So a sleep is never abandoned silently: one that does not answer within
  ``Timeouts.sleep_s`` raises :class:`~controller.lease.engines.errors.EngineStateUnknown`.
- A level-2 wake is four calls: ``wake_up?tags=weights``, ``collective_rpc
  reload_weights`` (``{"results": [null, ...]}``; the default loader only: it fails under
  ``--load-format dummy``), ``reset_prefix_cache`` (``{"success": bool}``; ``false`` fails
  the wake), ``wake_up?tags=kv_cache``. The reset comes before the KV cache is mapped
  (vLLM's docs list it last): until then the scheduler is paused, so no held request can
  hold blocks and make it fail. Skipping the reload gives garbage.
- ``/wake_up?tags=`` skips the **whole** call if any named tag is awake: the adapter
  names one tag per call. A wake that stops partway (an out-of-memory halfway, a failed
  reload) cannot be undone by ``/sleep`` (a no-op on a half-woken executor, the memory
  stays): it raises with ``unfinished`` set and :meth:`finish_wake` continues it.
- A wake that finds no room answers 500 with ``CUDA Error: out of memory``: that is
  :class:`~controller.lease.engines.errors.EngineRejected` with reason ``gpu_oom``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, StrictBool, ValidationError

from controller.lease.engines.base import SleepOutcome, check_level
from controller.lease.engines.common import ALL_TAGS, HttpEngineAdapter, Step
from controller.lease.engines.errors import EngineProtocolError, EngineRejected
from controller.lease.engines.transport import Answer

__all__ = ["LEVEL1_WAKE", "LEVEL2_WAKE", "VllmAdapter", "check_rpc_answer"]

log = logging.getLogger(__name__)

RELOAD_WEIGHTS = "reload_weights"
RESET_PREFIX_CACHE = "reset_prefix_cache"

LEVEL1_WAKE: tuple[Step, ...] = (Step("wake_up", "/wake_up", wakes=ALL_TAGS),)
"""Level 1: one call brings weights (from host memory) and KV cache back."""

LEVEL2_WAKE: tuple[Step, ...] = (
    Step("wake_up_weights", "/wake_up", params=(("tags", "weights"),), wakes=("weights",)),
    Step(RELOAD_WEIGHTS, "/collective_rpc", json_body={"method": "reload_weights"}),
    Step(RESET_PREFIX_CACHE, "/reset_prefix_cache"),
    Step("wake_up_kv_cache", "/wake_up", params=(("tags", "kv_cache"),), wakes=("kv_cache",)),
)
"""Level 2: map the weights, load them from disk, drop stale hashes, map the KV cache."""


class _RpcResults(BaseModel):
    model_config = ConfigDict(extra="ignore")

    results: list[object]


class _ResetAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    success: StrictBool


def check_rpc_answer(step: str, answer: Answer) -> None:
    """``collective_rpc`` answers ``{"results": [...]}`` (one entry per worker; older vLLM
    an empty body when every result is None). Anything else is a protocol error."""
    if not answer.body.strip():
        return
    try:
        _RpcResults.model_validate(answer.json(step))
    except ValidationError as exc:
        raise EngineProtocolError(f'{step}: the answer is not {{"results": [...]}}',
                                  step=step, body=answer.body) from exc


def check_reset_answer(step: str, answer: Answer) -> None:
    """``reset_prefix_cache`` answers ``{"success": bool}`` (older vLLM: an empty body);
    ``false`` (requests still hold blocks) fails the call."""
    if not answer.body.strip():
        return
    try:
        success = _ResetAnswer.model_validate(answer.json(step)).success
    except ValidationError as exc:
        raise EngineProtocolError(f'{step}: the answer is not {{"success": bool}}',
                                  step=step, body=answer.body) from exc
    if not success:
        raise EngineRejected(f"{step}: the engine could not reset its prefix cache "
                             "(success: false; requests still hold blocks)",
                             step=step, status=answer.status, body=answer.body)


class VllmAdapter(HttpEngineAdapter):
    """Drives a vLLM engine (levels 1 and 2)."""

    async def sleep(self, level: int, *, confirm: bool = True) -> SleepOutcome:
        check_level(level)
        step = Step("sleep", "/sleep", params=(("level", str(level)), ("mode", "wait")))
        sleep_s, _ = await self._sleep_call(step, budget_s=self.timeouts.sleep_s)
        if confirm:
            await self.confirm_asleep(level)
        log.info("engine asleep", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(sleep_s, 6), "confirmed": confirm})
        return SleepOutcome(level=level, sleep_s=sleep_s)

    def _wake_steps(self, level: int) -> Sequence[Step]:
        return LEVEL1_WAKE if check_level(level) == 1 else LEVEL2_WAKE

    def _check_answer(self, step: Step, answer: Answer) -> None:
        if step.name == RELOAD_WEIGHTS:
            check_rpc_answer(step.name, answer)
        elif step.name == RESET_PREFIX_CACHE:
            check_reset_answer(step.name, answer)
