"""The simulated engine's sleep state, as pure data: what is asleep and what is still valid.

vLLM tags its GPU memory ``weights`` and ``kv_cache``. This module keeps, per stage (a
plain engine has one stage, a vLLM-Omni engine several), where each tag lives and whether
the weights and the prefix cache can be trusted, and turns sleep and wake calls into
memory operations for a :class:`~e2e.engine_simulator.memory.MemoryHolder` to carry out.

- Level 1: weights are offloaded to host memory, the KV cache is discarded. Waking
  copies the weights back: answers stay right.
- Level 2: weights and KV cache are discarded and the prefix cache's hashes go stale.
  Waking the weights maps fresh, meaningless memory (``weights_valid`` false) until
  ``reload_weights``; answers stay wrong until ``reset_prefix_cache`` as well.
- Level 0: scheduling is paused; no memory moves.

Sleeping a tag that is asleep, or waking one that is awake, changes nothing (vLLM's
documented behaviour). No I/O and no asyncio here.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
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
    weights_valid: bool = True
    kv_cache_awake: bool = True
    prefix_cache_stale: bool = False
    paused: bool = False
    """Level-0 sleep: scheduling paused, memory untouched."""
    level: int | None = None
    """Level of the sleep this stage is in; None once fully awake."""

    @property
    def asleep(self) -> bool:
        return self.weights is not Residency.AWAKE or not self.kv_cache_awake or self.paused

    def sleeping_tags(self) -> list[Tag]:
        tags = []
        if self.weights is not Residency.AWAKE:
            tags.append(Tag.WEIGHTS)
        if not self.kv_cache_awake:
            tags.append(Tag.KV_CACHE)
        return tags

    def snapshot(self, stage_id: int) -> dict[str, Any]:
        return {
            "stage_id": stage_id,
            "asleep": self.asleep,
            "level": self.level,
            "weights": self.weights.value,
            "weights_valid": self.weights_valid,
            "kv_cache_awake": self.kv_cache_awake,
            "prefix_cache_stale": self.prefix_cache_stale,
            "paused": self.paused,
        }


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
        tags: Sequence[Tag] | None = None,
        stage_ids: Iterable[int] | None = None,
    ) -> list[MemoryOp]:
        """Put the chosen tags of the chosen stages to sleep at ``level`` (0, 1 or 2)."""
        if level not in (0, 1, 2):
            raise StateError(f"sleep level must be 0, 1 or 2, not {level}")
        wanted = ALL_TAGS if tags is None else tuple(dict.fromkeys(tags))
        ops: list[MemoryOp] = []
        for sid in self._select(stage_ids):
            stage = self.stages[sid]
            if level == 0:
                if not stage.paused:
                    stage.paused = True
                    stage.level = 0 if stage.level is None else stage.level
                continue
            changed = False
            if Tag.WEIGHTS in wanted and stage.weights is Residency.AWAKE:
                if level == 1:
                    stage.weights = Residency.OFFLOADED
                    ops.append(MemoryOp(sid, Tag.WEIGHTS, MemoryAction.OFFLOAD))
                else:
                    stage.weights = Residency.DISCARDED
                    stage.weights_valid = False
                    ops.append(MemoryOp(sid, Tag.WEIGHTS, MemoryAction.DISCARD))
                changed = True
            if Tag.KV_CACHE in wanted and stage.kv_cache_awake:
                stage.kv_cache_awake = False
                ops.append(MemoryOp(sid, Tag.KV_CACHE, MemoryAction.DISCARD))
                changed = True
            if changed:
                if level == 2:
                    stage.prefix_cache_stale = True
                if stage.level is None or stage.level == 0:
                    stage.level = level
                else:
                    stage.level = max(stage.level, level)
        return ops

    def wake(
        self,
        *,
        tags: Sequence[Tag] | None = None,
        stage_ids: Iterable[int] | None = None,
        reload_weights: bool = False,
    ) -> list[MemoryOp]:
        """Wake the chosen tags; ``reload_weights`` also makes re-mapped weights valid."""
        wanted = ALL_TAGS if tags is None else tuple(dict.fromkeys(tags))
        ops: list[MemoryOp] = []
        for sid in self._select(stage_ids):
            stage = self.stages[sid]
            stage.paused = False
            if Tag.WEIGHTS in wanted:
                if stage.weights is Residency.OFFLOADED:
                    ops.append(MemoryOp(sid, Tag.WEIGHTS, MemoryAction.RESTORE))
                elif stage.weights is Residency.DISCARDED:
                    ops.append(MemoryOp(sid, Tag.WEIGHTS, MemoryAction.REALLOCATE))
                    if reload_weights:
                        stage.weights_valid = True
                stage.weights = Residency.AWAKE
            if Tag.KV_CACHE in wanted and not stage.kv_cache_awake:
                stage.kv_cache_awake = True
                ops.append(MemoryOp(sid, Tag.KV_CACHE, MemoryAction.REALLOCATE))
            if not stage.asleep:
                stage.level = None
        return ops

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
        """What ``GET /is_sleeping`` answers: true until every tag of every stage is back."""
        return any(stage.asleep for stage in self.stages)

    @property
    def sleeping_tags(self) -> list[Tag]:
        found = {tag for stage in self.stages for tag in stage.sleeping_tags()}
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
