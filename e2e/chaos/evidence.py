"""What a failed campaign keeps of an engine it could not reach at the end: the node agent's
view of its pod (starts, exits, restarts), its container's last lines (the start gate's
questions and the answers it got), every lease controller's lines about its claim (the
start ticket: asked, granted, refused, restarted) and what the start-gate directory holds
(where the gates' path leads, which sockets answer). Enough to tell a gate that knocks on a
dead socket (review F4) from an engine that never got its turn.

Reads log files only; the campaign's logs are removed at its end unless ``--keep-logs``.
"""

from __future__ import annotations

import os
import stat
from collections import deque
from pathlib import Path
from typing import Any

from controller.lease.starts import listening
from e2e.harness.scenario import Engine

__all__ = ["LINES", "engine_log", "start_gate_view", "unreachable_engine"]

LINES = 15
"""Lines kept of each log."""


def engine_log(logs: Path, engine: Engine) -> Path:
    """Where the node agent writes an engine container's output (the gate's too)."""
    return logs / f"{engine.namespace}_{engine.spec.name}_engine.log"


def _last_lines(path: Path, needle: str = "", *, lines: int = LINES) -> list[str]:
    """The last ``lines`` lines of ``path`` that contain ``needle`` (read as a stream: a
    campaign's logs are large)."""
    kept: deque[str] = deque(maxlen=lines)
    try:
        with path.open(encoding="utf-8", errors="replace") as source:
            for line in source:
                if needle in line:
                    kept.append(line.rstrip()[:400])
    except FileNotFoundError:
        return ["(no such log)"]
    return list(kept)


def start_gate_view(directory: Path) -> list[str]:
    """Each entry of the start-gate directory: a link and where it leads, a socket and
    whether anything listens on it."""
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return ["(no start-gate directory)"]
    view = []
    for name in names:
        path = directory / name
        try:
            mode = path.lstat().st_mode
        except FileNotFoundError:
            continue
        answers = "answers" if listening(path) else "refuses"
        if stat.S_ISLNK(mode):
            view.append(f"{name} -> {os.readlink(path)} ({answers})")
        elif stat.S_ISSOCK(mode):
            view.append(f"{name}: socket ({answers})")
        else:
            view.append(f"{name}: {'directory' if stat.S_ISDIR(mode) else 'file'}")
    return view


def unreachable_engine(logs: Path, start_gate: Path, engine: Engine, *,
                       lines: int = LINES) -> dict[str, Any]:
    """The evidence about one engine that did not answer at the end of a campaign."""
    controllers = sorted(logs.glob("controller-*.log"))
    return {
        "engine": f"{engine.namespace}/{engine.spec.name}",
        "claim": engine.claim_uid,
        "node_agent": _last_lines(logs / "node-agent.log", engine.spec.name, lines=lines),
        "container": _last_lines(engine_log(logs, engine), lines=lines),
        "start_ticket": {log.name: _last_lines(log, engine.claim_uid, lines=lines)
                         for log in controllers} if engine.claim_uid else {},
        "start_gate": start_gate_view(start_gate),
    }
