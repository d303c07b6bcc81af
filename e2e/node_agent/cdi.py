"""Read CDI specs the way a container runtime would, to resolve device ids to edits."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class CdiResolveError(RuntimeError):
    """A CDI device id is unknown or its spec is unreadable."""


def _load_specs(cdi_root: Path) -> list[dict[str, Any]]:
    specs = []
    for path in sorted(cdi_root.glob("*.json")):
        try:
            specs.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            log.warning("unreadable CDI spec", extra={"path": str(path), "error": str(exc)})
    return specs


def resolve_env(cdi_root: Path, device_ids: Iterable[str]) -> dict[str, str]:
    """Environment a runtime would inject for ``device_ids`` (``vendor/class=name``).

    Spec-level edits come first, then each device's, in the order given; later values win.
    Engines run on the host, not in a mount namespace, so a value naming a mount's
    container path is given as the mount's host path (what the engine would see there).
    """
    specs = _load_specs(cdi_root)
    env: dict[str, str] = {}
    mounts: dict[str, str] = {}
    for qualified in device_ids:
        kind, sep, name = qualified.partition("=")
        if not sep:
            raise CdiResolveError(f"malformed CDI device id {qualified!r}")
        for spec in specs:
            if spec.get("kind") != kind:
                continue
            for device in spec.get("devices", []):
                if device.get("name") == name:
                    for edits in (spec.get("containerEdits") or {}, device["containerEdits"]):
                        for item in edits.get("env", []) or []:
                            key, _, value = str(item).partition("=")
                            env[key] = value
                        for mount in edits.get("mounts", []) or []:
                            mounts[str(mount["containerPath"])] = str(mount["hostPath"])
                    break
            else:
                continue
            break
        else:
            raise CdiResolveError(f"CDI device {qualified} is in no spec under {cdi_root}")
    return {key: mounts.get(value, value) for key, value in env.items()}
