"""The chart's default NVML source on a real GPU machine: the host driver's
``libnvidia-ml.so.1`` mounted as one file into a directory on ``LD_LIBRARY_PATH``
(``nvml.source=hostPath``), with every other copy of the library out of sight, as in a
driver container built from ``python:*-slim``. The real NVML backend then starts, lists
the GPUs, and the library it loaded is the mounted file.

It runs where a GPU is (marker ``gpu``) and skips itself elsewhere. It needs root,
``unshare`` and ``mount`` for a private mount namespace (nothing outside it changes).
"""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHART_MOUNT_DIR = "/run/rota/nvml"
"""Where the chart mounts the file (``LD_LIBRARY_PATH`` of the driver container)."""

PROBE = """
import json, sys
from driver.devices import discover
from driver.nvml.real import PynvmlBackend
backend = PynvmlBackend()
backend.init()
try:
    devices = discover(backend)
finally:
    backend.shutdown()
maps = open("/proc/self/maps").read().splitlines()
loaded = sorted({line.split()[-1] for line in maps if "libnvidia-ml" in line})
print(json.dumps({"gpus": [[d.name, d.uuid, d.memory_bytes] for d in devices],
                  "loaded": loaded}))
"""


def _host_copies() -> list[Path]:
    """Every libnvidia-ml.so.1 the dynamic loader could find on this machine."""
    found: set[Path] = set()
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                                 timeout=30, check=False).stdout
    except OSError:
        listing = ""
    for line in listing.splitlines():
        if "libnvidia-ml.so" in line and "=>" in line:
            found.add(Path(line.split("=>", 1)[1].strip()))
    for directory in ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/local/nvidia/lib64",
                      "/usr/local/nvidia/lib", "/run/nvidia/driver/usr/lib/x86_64-linux-gnu"):
        found.update(Path(directory).glob("libnvidia-ml.so*"))
    return sorted(p for p in found if p.exists())


def _configured() -> Path | None:
    """The host path an admin would set as nvml.hostPath on this machine."""
    given = os.environ.get("ROTA_NVML_HOST_PATH")
    if given:
        return Path(given)
    copies = [p for p in _host_copies() if p.name == "libnvidia-ml.so.1"]
    return copies[0] if copies else None


pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is None and _configured() is None,
                       reason="no NVIDIA driver (libnvidia-ml) on this machine"),
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                       reason="needs root and unshare for a private mount namespace"),
]


def test_real_nvml_from_the_mounted_host_file() -> None:
    host = _configured()
    assert host is not None
    with tempfile.TemporaryDirectory(prefix="rota-nvml-") as tmp:
        mount_dir = Path(tmp) / CHART_MOUNT_DIR.strip("/")
        mount_dir.mkdir(parents=True)
        target = mount_dir / "libnvidia-ml.so.1"
        target.touch()
        hide = [p for p in _host_copies() if p.resolve() != target]
        script = "set -e\n"
        # As the kubelet mounts a hostPath of type File: the resolved file, read-only.
        script += f"mount --bind {host.resolve()} {target}\n"
        script += f"mount -o remount,bind,ro {target}\n"
        # Every other copy out of sight: only LD_LIBRARY_PATH can find the library.
        for path in hide:
            script += f"mount --bind /dev/null {path.resolve()} || true\n"
        script += (f"cd {ROOT}\nexec env LD_LIBRARY_PATH={mount_dir} "
                   f"{sys.executable} -c '{PROBE}'\n")
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               script], capture_output=True, text=True, timeout=120,
                              check=False)
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        print(json.dumps({"host_file": str(host), "resolved": str(host.resolve()),
                          "hidden": [str(p) for p in hide], **seen}))
        assert seen["gpus"], "NVML started but reports no GPU"
        assert all(uuid.startswith("GPU-") for _, uuid, _ in seen["gpus"])
        assert seen["loaded"] == [str(target)]
