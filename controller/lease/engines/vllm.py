"""The adapter for vLLM's OpenAI server with sleep mode, vLLM 0.26 through 0.34.

It reads the engine's release first (:mod:`.dialect`) and speaks that release's surface:
0.32 on answer ``/sleep`` with ``{"status": "sleeping", "level": N}`` and ``/wake_up`` with
``{"status": "awake"|"sleeping", ...}``, checked here (``sleeping`` after the wake call that
should have woken the last tag is a partial wake: not awake); an engine whose ``/sleep`` no
longer handles running requests (RFC #51476) is paused with ``mode=wait`` first and
resumed after its wake. Below, 0.26's wire behaviour, which every release keeps.

vLLM serves its sleep controls only with ``VLLM_SERVER_DEV_MODE=1`` (and sleep needs
``--enable-sleep-mode``). These routes are **never authenticated** by vLLM, ``--api-key``
or not: anyone who reaches the engine's port can put it to sleep. Only the network (the
engines' NetworkPolicy) or rota's engine guard protects them; the control token this
adapter sends is checked by the guard alone. Its traps, and what this adapter does:

- ``POST /sleep`` reads the query only: a JSON body or a misspelt parameter is ignored and
  the engine sleeps at level 1 with ``mode=abort``. The adapter sends
  ``/sleep?level=N&mode=wait`` and no body. (The controller drains at the gateway first;
  ``wait`` is the second line of defence: ``abort`` races in-flight CUDA work.)
- A sleep that keeps requests (``sleep(1, keep=True)``, the preemptive switch) is
  ``/pause?mode=keep`` then ``/sleep?level=1&mode=keep``: a plain ``/sleep`` after the
  pause would abort what it kept (its default mode). Only where the release and the
  engine's route table serve ``/pause``, ``/resume`` and ``/is_paused`` (:func:`serves_keep`).
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
import time
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictInt, ValidationError

from controller.lease.engines.base import (
    KEEP_LEVELS,
    SleepOutcome,
    StepTiming,
    WakeOutcome,
    check_level,
)
from controller.lease.engines.common import ALL_TAGS, HttpEngineAdapter, Step
from controller.lease.engines.dialect import (
    Dialect,
    check_calls,
    detect,
    may_be_paused,
    not_paused,
    pausing,
)
from controller.lease.engines.errors import (
    EngineError,
    EngineProtocolError,
    EngineRejected,
    EngineStateUnknown,
    EngineUnsupported,
)
from controller.lease.engines.transport import Answer

__all__ = ["LEVEL1_WAKE", "LEVEL2_WAKE", "VllmAdapter", "calls", "check_rpc_answer",
           "serves_keep"]

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
FULL_WAKES = frozenset({"wake_up", "wake_up_kv_cache"})
"""The wake calls after which every tag must be awake (0.32 on say so in ``status``)."""
PAUSE = Step("pause", "/pause", params=(("mode", "wait"),))
"""Before a sleep that does not handle requests itself: finish the running ones, hold new
ones (``wait``, never ``abort``)."""
RESUME = Step("resume", "/resume")
PAUSE_KEEP = Step("pause_keep", "/pause", params=(("mode", "keep"),))
"""The first call of a sleep that keeps requests: running requests are preempted (their
output kept, recomputed after the wake), new ones held."""
IS_PAUSED_PATH = "/is_paused"
KEEP_CALLS = frozenset({("POST", PAUSE_KEEP.path), ("POST", RESUME.path),
                        ("GET", IS_PAUSED_PATH)})
"""What a sleep with requests kept needs besides the sleep and wake: the pause, the resume
after the wake, and the read that says whether a woken engine is still paused."""


class _IsPaused(BaseModel):
    model_config = ConfigDict(extra="ignore")

    is_paused: StrictBool


class _SleepAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: Literal["sleeping"]
    level: StrictInt


class _WakeAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    status: Literal["awake", "sleeping"]


def _wake_steps(level: int, dialect: Dialect) -> tuple[Step, ...]:
    steps = LEVEL1_WAKE if check_level(level) == 1 else LEVEL2_WAKE
    return steps if dialect.sleep_handles_requests else (*steps, RESUME)


def _sleep_step(level: int, dialect: Dialect, *, keep: bool = False) -> Step:
    params: tuple[tuple[str, str], ...] = (("level", str(level)),)
    if dialect.sleep_handles_requests:
        # after /pause?mode=keep, a /sleep of any other mode (its default is abort) would
        # end the kept requests; an engine whose /sleep is a memory step (RFC #51476)
        # takes no mode
        params += (("mode", "keep" if keep else "wait"),)
    return Step("sleep", "/sleep", params=params)


def _takes_keep(dialect: Dialect, path: str) -> bool:
    """The release's ``path`` reads a ``mode`` that may be ``keep`` (0.26-0.31's /sleep
    reads it raw: any string; 0.32 on declare the values)."""
    control = dialect.surface.control(path)
    mode = None if control is None else control.param("mode")
    return mode is not None and (not mode.values or "keep" in mode.values)


def serves_keep(dialect: Dialect) -> bool:
    """Whether an engine of ``dialect`` serves the sleep that keeps requests:
    ``/pause?mode=keep``, ``/sleep?mode=keep`` (where ``/sleep`` still takes a mode),
    ``/resume`` and ``/is_paused``, in its release and in its own route table. One that
    does not is drained before it sleeps, never kept."""
    if not all(dialect.serves(*call) for call in KEEP_CALLS):
        return False
    if not _takes_keep(dialect, PAUSE_KEEP.path):
        return False
    return not dialect.sleep_handles_requests or _takes_keep(dialect, "/sleep")


def calls(dialect: Dialect, levels: tuple[int, ...] = (1, 2)) -> frozenset[tuple[str, str]]:
    """Every (method, path) the adapter calls on an engine of ``dialect``."""
    found = {("GET", "/version"), ("GET", "/is_sleeping"), ("GET", "/health"),
             ("POST", "/sleep")}
    if not dialect.sleep_handles_requests:
        found.add(("POST", PAUSE.path))  # required: without it no sleep would be safe
    for level in levels:
        found |= {("POST", step.path) for step in _wake_steps(level, dialect)}
    return frozenset(found)


def keep_calls(dialect: Dialect) -> frozenset[tuple[str, str]]:
    """The calls a sleep with requests kept adds (none where the engine cannot keep)."""
    return KEEP_CALLS if serves_keep(dialect) else frozenset()


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


def check_sleep_answer(answer: Answer, level: int) -> None:
    """0.32 on: ``{"status": "sleeping", "level": N}`` with the level asked for."""
    try:
        said = _SleepAnswer.model_validate(answer.json("sleep"))
    except ValidationError as exc:
        raise EngineProtocolError('sleep: the answer is not {"status": "sleeping", "level": N}',
                                  step="sleep", body=answer.body) from exc
    if said.level != level:
        raise EngineProtocolError(f"sleep: asked for level {level}, the engine slept at "
                                  f"level {said.level}", step="sleep", body=answer.body)


def check_wake_answer(step: str, answer: Answer, *, full: bool) -> None:
    """0.32 on: ``{"status": "awake"|"sleeping"}``; ``sleeping`` after the call that should
    have woken every tag is a partial wake, which fails the step (not awake)."""
    try:
        said = _WakeAnswer.model_validate(answer.json(step))
    except ValidationError as exc:
        raise EngineProtocolError(f'{step}: the answer is not {{"status": "awake"|"sleeping"}}',
                                  step=step, body=answer.body) from exc
    if full and said.status != "awake":
        raise EngineRejected(f"{step}: the engine says it is still sleeping (some memory "
                             "tags were not woken): a partial wake is not awake",
                             step=step, status=answer.status, body=answer.body)


class VllmAdapter(HttpEngineAdapter):
    """Drives a vLLM engine (levels 1 and 2) of any supported release."""

    _dialect: Dialect | None = None

    async def dialect(self) -> Dialect:
        """The engine's dialect, checked against the calls this adapter makes."""
        if self._dialect is None:
            dialect = await detect(self._http)
            check_calls(dialect, calls(dialect), self.endpoint)
            self._dialect = dialect
        return self._dialect

    async def preflight(self) -> None:
        await self.dialect()

    async def can_keep(self, level: int) -> bool:
        """Whether this engine serves the sleep that keeps requests at ``level`` (only 1);
        False when its release cannot be read now (the switch then drains)."""
        if level not in KEEP_LEVELS:
            return False
        try:
            return serves_keep(await self.dialect())
        except EngineError as exc:
            log.warning("engine release not read: it is drained, not kept",
                        extra=self.endpoint.log_fields() | {"error": str(exc)[:200]})
            return False

    async def sleep(self, level: int, *, confirm: bool = True, keep: bool = False
                    ) -> SleepOutcome:
        check_level(level)
        dialect = await self.dialect()
        if keep:
            sleep_s = await self._keep_sleep(level, dialect)
        else:
            sleep_s = await self._wait_sleep(level, dialect)
        if confirm:
            await self.confirm_asleep(level)
        log.info("engine asleep", extra=self.endpoint.log_fields() | {
            "sleep_level": level, "seconds": round(sleep_s, 6), "confirmed": confirm,
            "kept": keep, "vllm_version": dialect.version})
        return SleepOutcome(level=level, sleep_s=sleep_s)

    async def _wait_sleep(self, level: int, dialect: Dialect) -> float:
        """The sleep that lets running requests finish (``mode=wait``; on an engine whose
        ``/sleep`` is a memory step, ``/pause?mode=wait`` first)."""
        began = time.monotonic()
        paused = not dialect.sleep_handles_requests
        if paused:
            # RFC #51476: /sleep is a pure memory step; running requests finish first
            await self._sleep_call(PAUSE, budget_s=self.timeouts.sleep_s)
        step = _sleep_step(level, dialect)
        budget_s = self.timeouts.sleep_s - (time.monotonic() - began)
        try:
            sleep_s, answer = await self._sleep_call(step, budget_s=budget_s)
            if dialect.sleep_answers_json:
                check_sleep_answer(answer, level)
        except EngineError:
            if paused:
                await self._resume_after_failed_sleep(step)
            raise
        return sleep_s

    async def _keep_sleep(self, level: int, dialect: Dialect) -> float:
        """The sleep that keeps requests in flight: ``/pause?mode=keep`` (running requests
        preempted, their output kept; new ones held), then ``/sleep?level=1&mode=keep``.
        Shown on vLLM 0.26 (H100): every kept stream continued after the wake identical
        to a never-slept reference. A plain ``/sleep`` after the pause would abort the
        kept requests (its default mode); ``/sleep?mode=keep`` alone keeps them too, but
        not once ``/sleep`` stops handling requests (RFC #51476), which the pause
        survives. The wake resumes (:meth:`_resume_if_paused`).

        A sleep that fails after the pause with a known outcome resumes the engine (the
        kept requests run on; the engine is awake); one whose outcome is unknown does not
        (it may still fall asleep; whoever settles it decides)."""
        if level not in KEEP_LEVELS:
            raise ValueError(f"requests are kept only across a level-1 sleep, not {level}")
        if not serves_keep(dialect):
            raise EngineUnsupported(
                f"vLLM {dialect.version} does not serve a sleep that keeps requests "
                "(/pause?mode=keep, /resume, /is_paused): drain it first", step="pause_keep")
        began = time.monotonic()
        pausing(self.endpoint)
        pause_s, _ = await self._sleep_call(PAUSE_KEEP, budget_s=self.timeouts.sleep_s)
        step = _sleep_step(level, dialect, keep=True)
        budget_s = self.timeouts.sleep_s - (time.monotonic() - began)
        try:
            sleep_s, answer = await self._sleep_call(step, budget_s=budget_s)
            if dialect.sleep_answers_json:
                check_sleep_answer(answer, level)
        except EngineStateUnknown:
            raise
        except EngineError:
            await self._resume_after_failed_sleep(step)
            raise
        return pause_s + sleep_s

    async def _resume_after_failed_sleep(self, step: Step) -> None:
        """Best effort: un-pause an engine whose sleep failed after its pause, so that it
        does not stay paused (serving nothing) with no sleep for a wake to undo. Its own
        failure is logged, never raised: the sleep's error is the one the caller needs."""
        try:
            await self._http.request(RESUME.name, "POST", RESUME.path,
                                     timeout_s=self.timeouts.status_s, control=True)
        except EngineError as exc:
            log.warning("engine left paused: the resume after a failed sleep failed",
                        extra=self.endpoint.log_fields() | {"step": step.name,
                                                            "error": str(exc)[:200]})
            return
        log.info("engine resumed after a failed sleep",
                 extra=self.endpoint.log_fields() | {"step": step.name})

    def _wake_steps(self, level: int) -> Sequence[Step]:
        if self._dialect is None:
            return LEVEL1_WAKE if check_level(level) == 1 else LEVEL2_WAKE
        return _wake_steps(level, self._dialect)

    async def _wake_from(self, level: int, start: int, *, confirm: bool = True
                         ) -> WakeOutcome:
        await self.dialect()
        return await super()._wake_from(level, start, confirm=confirm)

    async def _after_wake(self, level: int, timings: list[StepTiming]) -> None:
        """Resume an engine the wake left paused. vLLM 0.26-0.34 resume scheduling when
        the executor is fully awake, and an engine whose ``/sleep`` is a memory step
        (RFC #51476) ends its wake with ``/resume`` anyway; but a kept engine's requests
        must never stay frozen because some release's wake does not resume, so the wake
        asks ``/is_paused`` and resumes when the engine says so. It asks only where a
        sleep that keeps requests paused the engine since its last wake, or where this
        process has not seen the engine's run wake yet (a controller that restarted does
        not know who paused it): a read on the switch's path only when it can matter."""
        dialect = self._dialect
        if dialect is None or not dialect.sleep_handles_requests \
                or not dialect.serves("GET", IS_PAUSED_PATH) \
                or not may_be_paused(self.endpoint):
            return
        try:
            paused = await self._is_paused()
        except EngineError as exc:
            # the probe that follows every wake finds an engine that holds its requests
            log.warning("could not read whether the woken engine is paused",
                        extra=self.endpoint.log_fields() | {"error": str(exc)[:200]})
            return
        if not paused:
            not_paused(self.endpoint)
            return
        if not await self._executor_awake(dialect):
            # resuming a sleeping executor would run requests on unmapped memory (vLLM's
            # engine core dies of it): leave it paused; the confirmation and the probe
            # that follow every wake say what is wrong
            log.warning("engine paused after its wake, its memory not shown awake: not "
                        "resumed", extra=self.endpoint.log_fields() | {"sleep_level": level})
            return
        log.info("engine still paused after its wake: resuming",
                 extra=self.endpoint.log_fields() | {"sleep_level": level})
        await self._run_step(RESUME, deadline=time.monotonic() + self.timeouts.status_s,
                             budget_s=self.timeouts.status_s, timings=timings)
        not_paused(self.endpoint)

    async def _executor_awake(self, dialect: Dialect) -> bool:
        """Whether the wake that just completed left every memory tag awake: 0.32 on say
        so in the answer of the wake's last call (checked: ``awake``); before, only
        ``vllm:engine_sleep_state`` can tell (no gauge: not shown awake)."""
        if dialect.wake_answers_status:
            return True
        try:
            return await self.sleep_gauge() == "awake"
        except EngineError:
            return False

    async def _is_paused(self) -> bool:
        """The engine's ``/is_paused``; False where it is hidden (404: a guard older than
        this adapter), as nothing of rota's paused such an engine with keep."""
        answer = await self._http.read("is_paused", IS_PAUSED_PATH, control=True,
                                       accept=frozenset({404}))
        if answer.status == 404:
            return False
        try:
            return _IsPaused.model_validate(answer.json("is_paused")).is_paused
        except ValidationError as exc:
            raise EngineProtocolError('is_paused: the answer is not {"is_paused": bool}',
                                      step="is_paused", body=answer.body) from exc

    def _check_answer(self, step: Step, answer: Answer) -> None:
        if step.name == RELOAD_WEIGHTS:
            check_rpc_answer(step.name, answer)
        elif step.name == RESET_PREFIX_CACHE:
            check_reset_answer(step.name, answer)
        elif step.path == "/wake_up" and self._dialect is not None \
                and self._dialect.wake_answers_status:
            check_wake_answer(step.name, answer, full=step.name in FULL_WAKES)
