"""The driver's settings: parsed once at start, passed explicitly, every flag also an env var.

Nothing else in the driver reads ``os.environ``. Each field's description is its
``--help`` text; the flag is ``--<field-with-dashes>`` and the environment variable
``ROTA_<FIELD>`` (``NODE_NAME`` too for the node, as the downward API usually sets it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from driver import DRIVER_NAME
from rota.kit.settings import LogLevel, parse_settings


class NvmlBackendKind(StrEnum):
    REAL = "real"
    FAKE = "fake"


class DriverSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    node_name: str = Field(description="Name of this Node (the pool name). Env NODE_NAME works "
                                       "too.")
    kubeconfig: str | None = Field(default=None, description="kubeconfig file; in-cluster "
                                                             "service account when unset.")
    sharing_mode: str = Field(default="shared", description="exclusive | shared | partitioned. "
                              "shared publishes consumable capacity; the driver falls back to "
                              "partitioned (then exclusive) when the API server drops fields.")
    engines_per_gpu: int = Field(default=8, ge=2, le=64,
                                 description="How many claimants may share one GPU (the "
                                             "'engines' capacity; also the partition count).")
    plugin_registry_dir: Path = Field(default=Path("/var/lib/kubelet/plugins_registry"),
                                      description="The kubelet's plugin registration directory.")
    plugin_data_dir: Path = Field(default=Path(f"/var/lib/kubelet/plugins/{DRIVER_NAME}"),
                                  description="Directory of the DRA socket and the ledger.")
    inspect_dir: Path | None = Field(default=None, description="Directory of the inspection "
                                     "socket, the only part of the driver the lease "
                                     "controller needs (mount it alone, read-only, into the "
                                     "controller); default: the plugin data directory.")
    cdi_root: Path = Field(default=Path("/var/run/cdi"), description="Where CDI specs go.")
    dev_root: Path = Field(default=Path("/dev"), description="Device node directory named in "
                                                             "CDI specs.")
    dev_root_mount: Path | None = Field(default=None, description="Where this driver sees "
                                        "--dev-root live (a read-only mount of the host's "
                                        "directory); device nodes are looked for there. "
                                        "Default: --dev-root itself, which in a container is "
                                        "a copy made when it started.")
    proc_root: Path = Field(default=Path("/proc"), description="procfs, for process cgroups.")
    nvml_backend: NvmlBackendKind = Field(default=NvmlBackendKind.REAL,
                                          description="real (pynvml) or fake (a JSON fixture).")
    fake_nvml_fixture: Path | None = Field(default=None, description="GPU description for the "
                                           "fake NVML backend: a file, or the name of one "
                                           "shipped with the driver (h200, h200x8).")
    fake_nvml_proc_dir: Path | None = Field(default=None, description="Directory where "
                                            "simulated engines register their GPU memory.")
    http_address: str = Field(default="127.0.0.1:8081", description="host:port of /metrics, "
                              "/healthz and /readyz; port 0 picks one; '[::]:8081' is every "
                              "IPv6 and IPv4 address (one dual-stack socket).")
    slice_resync_s: float = Field(default=30.0, gt=0, description="Re-check the published "
                                  "slices at least this often, watch events aside.")
    api_timeout_s: float = Field(default=10.0, gt=0, description="Timeout of each API call.")
    api_qps: float = Field(default=5.0, ge=0, description="Client-side limit on Kubernetes "
                           "API requests per second (a token bucket; 0: none).")
    api_burst: int = Field(default=10, ge=1, description="Kubernetes API requests that may "
                           "go out at once, above --api-qps, after a quiet spell.")
    lock_timeout_s: float = Field(default=10.0, gt=0, description="Wait at most this long for "
                                  "the node-wide prepare lock.")
    pod_uid: str | None = Field(default=None, description="This driver pod's uid (downward "
                                "API). When set, the registration and DRA sockets carry it, "
                                "so two driver pods can overlap during a rolling update. Env "
                                "POD_UID works too.")
    start_gate_dir: Path | None = Field(default=Path("/var/run/rota/start"), description=(
        "Directory of the start-gate socket (the lease controller listens there); mounted "
        "read-only into the containers of every claim with an engine config, with the "
        "claim's token in ROTA_START_TOKEN. Empty: no start gate."))
    log_level: LogLevel = Field(default="info", description="debug | info | warning | error")

    @field_validator("start_gate_dir", mode="before")
    @classmethod
    def _empty_is_off(cls, value: object) -> object:
        return None if value == "" else value

    @field_validator("sharing_mode")
    @classmethod
    def _known_mode(cls, value: str) -> str:
        if value not in ("exclusive", "shared", "partitioned"):
            raise ValueError("must be exclusive, shared or partitioned")
        return value

    @field_validator("node_name")
    @classmethod
    def _non_empty(cls, value: str) -> str:
        if not value:
            raise ValueError("must not be empty (set --node-name or NODE_NAME)")
        return value

    @property
    def dra_socket(self) -> Path:
        if not self.pod_uid:
            return self.plugin_data_dir / "dra.sock"
        return self.plugin_data_dir / f"dra-{_short(self.pod_uid)}.sock"

    @property
    def registration_socket(self) -> Path:
        if not self.pod_uid:
            return self.plugin_registry_dir / f"{DRIVER_NAME}-reg.sock"
        return self.plugin_registry_dir / f"{DRIVER_NAME}-{_short(self.pod_uid)}-reg.sock"

    @property
    def inspect_socket(self) -> Path:
        """Where the lease controller dials the inspection API (with a pod uid: a symlink
        to the socket of the newest driver pod)."""
        return (self.inspect_dir or self.plugin_data_dir) / "inspect.sock"

    @property
    def inspect_listen_socket(self) -> Path:
        if not self.pod_uid:
            return self.inspect_socket
        base = self.inspect_dir or self.plugin_data_dir
        return base / f"inspect-{_short(self.pod_uid)}.sock"

    @property
    def ledger_path(self) -> Path:
        return self.plugin_data_dir / "ledger.json"

    @property
    def lock_path(self) -> Path:
        return self.plugin_data_dir / "prepare.lock"

    @property
    def start_gate_key_path(self) -> Path:
        """The node key (never mounted into any container): start-gate and control tokens
        derive from it; created even with the start gate off. Its name predates the control
        tokens and is kept, so that an upgrade keeps every running engine's tokens."""
        return self.plugin_data_dir / "start-gate.key"


def _short(pod_uid: str) -> str:
    """A pod uid as it may appear in a socket name: as is when short and plain, else a
    hash (unix socket paths are limited to 107 bytes)."""
    if len(pod_uid) <= 36 and all(c.isalnum() or c == "-" for c in pod_uid):
        return pod_uid
    return hashlib.sha256(pod_uid.encode()).hexdigest()[:16]


def load(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None
         ) -> DriverSettings:
    settings: DriverSettings = parse_settings(
        DriverSettings, argv, environ, prog="rota-driver",
        description="rota's DRA kubelet plugin for driver gpu.rota.dev: publishes GPUs as "
                    "shared devices, prepares claims, keeps a crash-safe ledger.")
    return settings
