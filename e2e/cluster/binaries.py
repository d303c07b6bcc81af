"""Where the control-plane binaries come from: the project's build script and its cache."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REQUIRED = ("etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager")
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "toolchain" / "build-k8s.sh"


class BinariesMissing(RuntimeError):
    """The binaries are not built and building them failed."""


def locate(*, build: bool = True) -> Path:
    """Return the directory holding the four binaries, building them when absent.

    ``ROTA_K8S_BIN`` names a directory to use as is. Otherwise the build script decides
    the cached location (it prints it on its last line) and builds only what is missing.
    """
    override = os.environ.get("ROTA_K8S_BIN")
    if override:
        path = Path(override)
        missing = [b for b in REQUIRED if not (path / b).is_file()]
        if missing:
            raise BinariesMissing(f"ROTA_K8S_BIN={path} lacks {', '.join(missing)}")
        return path
    if not build:
        raise BinariesMissing("set ROTA_K8S_BIN or allow building")
    proc = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True,
                          check=False)
    if proc.returncode != 0:
        raise BinariesMissing(f"{BUILD_SCRIPT.name} failed with exit code {proc.returncode}")
    return Path(proc.stdout.strip().splitlines()[-1])
