"""An OCI registry on the loopback address, holding rota's released image and chart.

The registry is go-containerregistry's (``crane registry serve``, built from the Go module
proxy by ``e2e/toolchain/build-registry.sh`` into the tool cache; ``ROTA_REGISTRY_TOOLS_BIN``
names a directory that holds ``crane`` already). :class:`LocalRegistry` serves it on
``127.0.0.1:<free port>`` over plain HTTP with its blobs in a data directory, waits (bounded)
until ``/v2/`` answers, and stops it on every exit path (a context manager; the process
also dies with its parent). A release goes into it as an admin's goes into theirs
(docs/install.md, ``e2e/release/publish.py``): ``make push REGISTRY=<address>/rota-dev
SIGNING_KEY=... PLAIN_HTTP=1`` (:attr:`LocalRegistry.target`) puts the image at
``<address>/rota-dev/rota:<v>`` (the manifest's bytes, so its digest, are the release
archive's: the digest the released chart pins) and the chart at
``oci://<address>/rota-dev/charts/rota``, both signed; ``make verify`` checks them, and
``helm install rota oci://<address>/rota-dev/charts/rota --version <v> --plain-http``
installs it.

A real node pulls from it with ``RealNodeOptions(registry_ports=[port])``: its containerd
gets a ``hosts.toml`` for the plain-HTTP registry (``e2e.cluster.node_config``) and the
node's ``127.0.0.1:<port>`` is relayed to the host's.
"""

from __future__ import annotations

import os
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from e2e.cluster.local import free_port
from e2e.cluster.processes import ManagedProcess
from e2e.harness.waiting import eventually
from e2e.release.toolchain import tool_dir

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = ROOT / "e2e" / "toolchain" / "build-registry.sh"
PREFIX = "rota-dev"
"""The path below the registry's address that releases are pushed to (``REGISTRY``'s)."""
IMAGE_PATH = f"{PREFIX}/rota"
"""The image's repository below the registry's address (as below ``ghcr.io``)."""
CHART_PATH = f"{PREFIX}/charts"
READY_TIMEOUT_S = 30.0


class RegistryError(RuntimeError):
    """The registry did not start, or a push failed; the message carries the output."""


def registry_tools_bin() -> Path:
    """The directory holding ``crane`` (built on first use, then cached)."""
    return tool_dir("ROTA_REGISTRY_TOOLS_BIN", BUILD_SCRIPT, error=RegistryError,
                    timeout_s=1800.0)


def _run(argv: list[str], *, env: Mapping[str, str] | None = None,
         timeout_s: float = 300.0) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False,
                          timeout=timeout_s, env={**os.environ, **(env or {})})
    if done.returncode != 0:
        raise RegistryError(f"{' '.join(argv)} exited {done.returncode}:\n"
                            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done.stdout


class LocalRegistry:
    """``crane registry serve`` on ``127.0.0.1``, blobs under ``data_dir``."""

    def __init__(self, data_dir: Path, *, bin_dir: Path | None = None,
                 port: int | None = None) -> None:
        self.data_dir = data_dir
        self.bin_dir = bin_dir or registry_tools_bin()
        self.port = port or free_port()
        self.process: ManagedProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def crane(self) -> str:
        return str(self.bin_dir / "crane")

    @property
    def log_path(self) -> Path:
        return self.data_dir.parent / f"{self.data_dir.name}.log"

    def __enter__(self) -> LocalRegistry:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.process = ManagedProcess(
            name="registry", log_path=self.log_path, exe=self.crane,
            argv=[self.crane, "registry", "serve", "--address", self.address,
                  "--disk", str(self.data_dir)])
        self.process.start()
        try:
            eventually(self._answers, timeout=READY_TIMEOUT_S, max_interval=0.5,
                       what=f"the registry answering on {self.address}")
        except BaseException:
            self.stop()
            raise

    def _answers(self) -> bool:
        assert self.process is not None
        if not self.process.alive():
            raise RegistryError(f"the registry exited:\n{self.process.log_tail()}")
        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/", timeout=2) as answer:
                return bool(answer.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop(timeout_s=10)
            self.process = None

    def log_tail(self, lines: int = 30) -> str:
        return self.process.log_tail(lines) if self.process is not None else ""

    # -- contents ----------------------------------------------------------------------

    @property
    def target(self) -> str:
        """``make push``'s ``REGISTRY`` for this registry."""
        return f"{self.address}/{PREFIX}"

    def image_ref(self, tag: str) -> str:
        return f"{self.address}/{IMAGE_PATH}:{tag}"

    def chart_ref(self) -> str:
        """The chart's ``oci://`` reference (no version), as ``helm install`` takes it."""
        return f"oci://{self.address}/{CHART_PATH}/rota"

    def digest(self, ref: str) -> str:
        return _run([self.crane, "digest", "--insecure", ref], timeout_s=60).strip()

    def tags(self, repository: str) -> list[str]:
        out = _run([self.crane, "ls", "--insecure", f"{self.address}/{repository}"],
                   timeout_s=60)
        return sorted(out.split())

