"""A record of every running real node, so that a start can remove what a crashed run left.

Each node writes ``<cache>/nodes/<id>.json`` when it starts and removes it when it stops:
its holder's pid and start time, the pid and start time of the process that owns it (the
test run; none for ``rota-cluster up``), its cgroups and its directory. A record whose
owner or holder is gone (a pid whose start time differs is gone too) is a leftover:
:func:`remove_leftovers` kills what is still in its cgroups, removes the cgroups and the
directory, and drops the record. Records of live owners (another test run) are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
from pathlib import Path

from pydantic import BaseModel

from e2e.cluster.node_cgroups import NodeCgroups
from e2e.images.cache import cache_root

log = logging.getLogger(__name__)


def registry_dir() -> Path:
    return cache_root().parent / "nodes"


def start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of ``pid``; None when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def _alive(pid: int | None, started: int | None) -> bool:
    return pid is not None and started is not None and start_time(pid) == started


class NodeRecord(BaseModel):
    id: str
    name: str
    node_dir: Path
    cgroup_path: str
    cgroups_created: list[Path]
    holder_pid: int
    holder_start: int
    owner_pid: int | None
    owner_start: int | None

    @property
    def file(self) -> Path:
        return registry_dir() / f"{self.id}.json"

    def save(self) -> None:
        self.file.parent.mkdir(parents=True, exist_ok=True)
        temp = self.file.with_suffix(".tmp")
        temp.write_text(self.model_dump_json(indent=2))
        os.replace(temp, self.file)

    def drop(self) -> None:
        self.file.unlink(missing_ok=True)

    def is_leftover(self) -> bool:
        if not _alive(self.holder_pid, self.holder_start):
            return True
        return self.owner_pid is not None and not _alive(self.owner_pid, self.owner_start)


def owner() -> tuple[int, int | None]:
    return os.getpid(), start_time(os.getpid())


def remove(record: NodeRecord) -> None:
    """Remove everything of a node that is not running any more (or must not be)."""
    if _alive(record.holder_pid, record.holder_start):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.holder_pid, signal.SIGKILL)
    cgroups = NodeCgroups(path=record.cgroup_path, created=list(record.cgroups_created))
    cgroups.kill()
    cgroups.remove()
    shutil.rmtree(record.node_dir, ignore_errors=True)
    record.drop()


def load(record_id: str) -> NodeRecord | None:
    path = registry_dir() / f"{record_id}.json"
    try:
        return NodeRecord.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def remove_leftovers() -> list[str]:
    """Remove every leftover node on this machine; the names of those removed."""
    removed: list[str] = []
    directory = registry_dir()
    if not directory.is_dir():
        return removed
    for path in sorted(directory.glob("*.json")):
        try:
            record = NodeRecord.model_validate_json(path.read_text())
        except (OSError, ValueError):
            path.unlink(missing_ok=True)
            continue
        if record.is_leftover():
            log.warning("removing a node left by a run that ended without stopping it",
                        extra={"node": record.name, "node_dir": str(record.node_dir)})
            remove(record)
            removed.append(record.name)
    return removed
