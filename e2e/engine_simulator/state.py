"""The simulated engine's sleep state, as pure data: what is asleep and what is still valid.

vLLM tags its GPU memory ``weights`` and ``kv_cache``. Two layers keep track of it, and
they can disagree, as they do in vLLM 0.26:

- the **executor** keeps ``sleeping_tags``: a sleep puts every tag in it, a successful
  wake takes the woken tags out. ``is_sleeping`` of the executor is "any tag in it". A
  sleep while the executor is already sleeping does nothing ("Executor is already
  sleeping"); a wake while it is not does nothing; a wake naming a tag that is not in
  ``sleeping_tags`` skips the **whole** call;
- the **allocator** (CuMem) maps each tag's memory (per stage: a plain engine has one
  stage, a vLLM-Omni engine several). A wake maps what it needs one portion at a time;
  when the device runs out halfway, what was mapped stays mapped and the executor still
  lists every tag asleep. Only finishing the wake (or a restart) gets the engine out of
  that state: a new sleep is a no-op and the memory stays.

This module keeps both, plus whether the weights and the prefix cache can be trusted:

- Level 1: weights are offloaded to host memory, the KV cache is discarded. Waking
  copies the weights back: answers stay right.
- Level 2: weights and KV cache are discarded and the prefix cache's hashes go stale.
  Waking the weights maps fresh, meaningless memory (``weights_valid`` false) until
  ``reload_weights``; answers stay wrong until ``reset_prefix_cache`` as well (more
  pessimistic than vLLM 0.26, whose sleep clears the prefix cache itself).

Sleep and wake calls become memory operations for a
:class:`~e2e.engine_simulator.memory.MemoryHolder`. A wake is planned first
(:meth:`EngineState.plan_wake`), its operations are carried out one by one
(:meth:`EngineState.mapped`), and only a wake that mapped everything it needed is
completed (:meth:`EngineState.complete_wake`). No I/O and no asyncio here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ALL_TAGS",
    "EngineState",
    "MemoryAction",
    "MemoryOp",
    "Quality",
    "Residency",
    "StageState",
    "StateError",
    "Tag",
    "WakePlan",
    "portion_name",
]


class Tag(enum.StrEnum):
    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"


ALL_TAGS: tuple[Tag, ...] = (Tag.WEIGHTS, Tag.KV_CACHE)


class Residency(enum.StrEnum):
    AWAKE = "awake"
    OFFLOADED = "offloaded"
    """Copied to host memory (level 1); the device copy is freed."""
    DISCARDED = "discarded"


class MemoryAction(enum.StrEnum):
    OFFLOAD = "offload"
    """Copy device to host, then free the device memory."""
    DISCARD = "discard"
    """Free the device memory; the contents are lost."""
    RESTORE = "restore"
    """Allocate device memory and copy the host copy back."""
    REALLOCATE = "reallocate"
    """Allocate device memory; its contents are meaningless."""


class Quality(enum.StrEnum):
    """What a generation would produce in the current state."""

    CORRECT = "correct"
    GARBAGE_WEIGHTS = "garbage_weights"
    STALE_PREFIX_CACHE = "stale_prefix_cache"


class StateError(Exception):
    """The call is impossible in the current state (a real engine would fail or crash)."""


def portion_name(stage: int, tag: Tag) -> str:
    """The memory holder's name for one tag of one stage."""
    return f"stage{stage}/{tag.value}"


@dataclass(frozen=True)
class MemoryOp:
    stage: int
    tag: Tag
    action: MemoryAction

    @property
    def portion(self) -> str:
        return portion_name(self.stage, self.tag)


@dataclass
class StageState:
    weights: Residency = Residency.AWAKE
    """Where the allocator holds the weights."""
    weights_valid: bool = True
    kv_cache_awake: bool = True
    """Whether the allocator maps the KV cache."""
    prefix_cache_stale: bool = False
    sleeping_tags: set[Tag] = field(default_factory=set)
    """The executor's bookkeeping: tags it considers asleep."""
    level: int | None = None
    """Level of the sleep this stage is in; None once fully awake."""

    @property
    def asleep(self) -> bool:
        """The executor says this stage sleeps (some tag is in ``sleeping_tags``)."""
        return bool(self.sleeping_tags)

    def mapped(self, tag: Tag) -> bool:
        if tag is Tag.WEIGHTS:
            return self.weights is Residency.AWAKE
        return self.kv_cache_awake

    def snapshot(self, stage_id: int) -> dict[str, Any]:
        return {
            "stage_id": stage_id,
            "asleep": self.asleep,
            "level": self.level,
            "sleeping_tags": [t.value for t in ALL_TAGS if t in self.sleeping_tags],
            "weights": self.weights.value,
            "weights_valid": self.weights_valid,
            "kv_cache_awake": self.kv_cache_awake,
            "prefix_cache_stale": self.prefix_cache_stale,
        }


@dataclass(frozen=True)
class WakePlan:
    """What a wake call will do.

    Attributes:
        ops: allocations to make, in order (portions already mapped are left out).
        stages: the stages whose executor wakes (and their tags leave ``sleeping_tags``
            once every op succeeded).
        tags: the tags asked for; None means all.
        skipped: why nothing will be done (a warning vLLM logs), or None.
    """

    ops: tuple[MemoryOp, ...]
    stages: tuple[int, ...]
    tags: tuple[Tag, ...] | None
    skipped: str | None = None


class EngineState:
    """Sleep state of every stage; methods return the memory operations they imply."""

    def __init__(self, stages: int = 1) -> None:
        if stages < 1:
            raise ValueError("an engine has at least one stage")
        self.stages = [StageState() for _ in range(stages)]

    def _select(self, stage_ids: Iterable[int] | None) -> list[int]:
        if stage_ids is None:
            return list(range(len(self.stages)))
        chosen = sorted(set(stage_ids))
        unknown = [s for s in chosen if not 0 <= s < len(self.stages)]
        if unknown:
            raise StateError(
                f"unknown stage id(s) {unknown}; this engine has stages 0..{len(self.stages) - 1}"
            )
        return chosen

    def sleep(
        self,
        level: int,
        *,
        stage_ids: Iterable[int] | None = None,
        undo_partial_wake: bool = False,
    ) -> list[MemoryOp]:
        """The executor's ``sleep(level)`` on the chosen stages (level 1 or 2).

        A stage whose executor is already sleeping is left as it is (vLLM: "Executor is
        already sleeping"), even when part of its memory is mapped again after a wake
        that did not finish; ``undo_partial_wake`` (a kinder fault) frees that memory.
        """
        if level not in (1, 2):
            raise StateError(f"sleep level must be 1 or 2, not {level}")
        ops: list[MemoryOp] = []
        for sid in self._select(stage_ids):
            stage = self.stages[sid]
            if stage.asleep and not undo_partial_wake:
                continue
            if stage.weights is Residency.AWAKE:
                if level == 1:
                    stage.weights = Residency.OFFLOADED
                    ops.append(MemoryOp(sid, Tag.WEIGHTS, MemoryAction.OFFLOAD))
                else:
                    stage.weights = Residency.DISCARDED
                    stage.weights_valid = False
                    ops.append(MemoryOp(sid, Tag.WEIGHTS, MemoryAction.DISCARD))
            if stage.kv_cache_awake:
                stage.kv_cache_awake = False
                ops.append(MemoryOp(sid, Tag.KV_CACHE, MemoryAction.DISCARD))
            if not stage.asleep:
                stage.level = level
                if level == 2:
                    stage.prefix_cache_stale = True
            stage.sleeping_tags = set(ALL_TAGS)
        return ops

    def plan_wake(
        self,
        *,
        tags: Sequence[Tag] | None = None,
        stage_ids: Iterable[int] | None = None,
        each_tag: bool = False,
    ) -> WakePlan:
        """Plan the executor's ``wake_up(tags)``; nothing changes until ops are applied.

        ``each_tag`` (a kinder fault) wakes every named tag that is asleep and ignores the
        others, instead of skipping the whole call when one of them is awake.
        """
        wanted = ALL_TAGS if tags is None else tuple(dict.fromkeys(tags))
        chosen = self._select(stage_ids)
        asleep = [sid for sid in chosen if self.stages[sid].asleep]
        if not asleep:
            return WakePlan((), (), None if tags is None else wanted,
                            skipped="Executor is not sleeping.")
        if tags is not None and not each_tag:
            for sid in asleep:
                missing = [t for t in wanted if t not in self.stages[sid].sleeping_tags]
                if missing:
                    return WakePlan((), (), wanted, skipped=(
                        f"Tag {missing[0].value} is not in sleeping tags "
                        f"{sorted(t.value for t in self.stages[sid].sleeping_tags)}"))
        ops: list[MemoryOp] = []
        for sid in asleep:
            stage = self.stages[sid]
            for tag in wanted:
                if each_tag and tag not in stage.sleeping_tags:
                    continue
                if stage.mapped(tag):
                    continue  # mapped by an earlier wake that ran out halfway
                if tag is Tag.WEIGHTS:
                    action = (MemoryAction.RESTORE if stage.weights is Residency.OFFLOADED
                              else MemoryAction.REALLOCATE)
                else:
                    action = MemoryAction.REALLOCATE
                ops.append(MemoryOp(sid, tag, action))
        return WakePlan(tuple(ops), tuple(asleep), None if tags is None else wanted)

    def mapped(self, op: MemoryOp) -> None:
        """Record that the allocator mapped ``op``'s portion (the executor is not told)."""
        stage = self.stages[op.stage]
        if op.tag is Tag.WEIGHTS:
            if op.action is MemoryAction.REALLOCATE:
                stage.weights_valid = False
            stage.weights = Residency.AWAKE
        else:
            stage.kv_cache_awake = True

    def complete_wake(self, plan: WakePlan, *, reload_weights: bool = False) -> None:
        """Every op of ``plan`` succeeded: the woken tags leave ``sleeping_tags``.

        ``reload_weights`` (vLLM-Omni's all-in-one wake) also makes the weights valid.
        """
        for sid in plan.stages:
            stage = self.stages[sid]
            woken = set(ALL_TAGS) if plan.tags is None else set(plan.tags)
            stage.sleeping_tags -= woken
            if reload_weights and stage.weights is Residency.AWAKE:
                stage.weights_valid = True
            if not stage.asleep:
                stage.level = None

    def reload_weights(self) -> None:
        """``collective_rpc reload_weights``: needs the weights mapped, makes them valid."""
        unmapped = [i for i, s in enumerate(self.stages) if s.weights is not Residency.AWAKE]
        if unmapped:
            raise StateError(
                "reload_weights needs the weights woken first (wake_up?tags=weights); "
                f"weights asleep on stage(s) {unmapped}"
            )
        for stage in self.stages:
            stage.weights_valid = True

    def reset_prefix_cache(self) -> None:
        for stage in self.stages:
            stage.prefix_cache_stale = False

    def check_stage_ids(self, stage_ids: Iterable[int]) -> list[int]:
        """The distinct stage ids, sorted; :class:`StateError` names any unknown one."""
        return self._select(stage_ids)

    def stage_asleep(self, stage_id: int) -> bool:
        return self.stages[self._select([stage_id])[0]].asleep

    @property
    def is_sleeping(self) -> bool:
        """The executor's ``is_sleeping``: some tag of some stage is asleep."""
        return any(stage.asleep for stage in self.stages)

    @property
    def all_mapped(self) -> bool:
        """Every tag of every stage is mapped (the memory of a fully awake engine)."""
        return all(s.mapped(t) for s in self.stages for t in ALL_TAGS)

    @property
    def sleeping_tags(self) -> list[Tag]:
        found = {tag for stage in self.stages for tag in stage.sleeping_tags}
        return [tag for tag in ALL_TAGS if tag in found]

    @property
    def level(self) -> int | None:
        levels = [s.level for s in self.stages if s.asleep and s.level is not None]
        return max(levels) if levels else None

    @property
    def weights_valid(self) -> bool:
        return all(stage.weights_valid for stage in self.stages)

    @property
    def prefix_cache_stale(self) -> bool:
        return any(stage.prefix_cache_stale for stage in self.stages)

    def quality(self) -> Quality:
        if not self.weights_valid:
            return Quality.GARBAGE_WEIGHTS
        if self.prefix_cache_stale:
            return Quality.STALE_PREFIX_CACHE
        return Quality.CORRECT

    def snapshot(self) -> list[dict[str, Any]]:
        return [stage.snapshot(i) for i, stage in enumerate(self.stages)]
