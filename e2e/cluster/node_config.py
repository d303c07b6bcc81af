"""The configuration files of a real node, as pure functions of its settings.

Paths here are the node's own (inside its mount namespace ``/run``, ``/var/lib`` and
``/var/log`` are the node's directories). What each setting is for:

- containerd: CDI on (always, in 2.x) with the standard spec directories; the pause image
  pinned as the sandbox image (there is no registry to pull one from); the registry hosts
  directory (``config_path``) where a node pulls from plain-HTTP registries on the host's
  loopback (:func:`registry_hosts`, one ``<host:port>/hosts.toml`` each);
  ``restrict_oom_score_adj`` because the machine forbids negative OOM scores (runc would
  fail every sandbox otherwise); cgroupfs; the plugin that would create ``/opt/containerd``
  on the machine disabled.
- CNI: a bridge with a /24 per node, so pod addresses are unique across the cluster.
- kubelet: ``failCgroupV1: false`` (the machine has cgroup v1; 1.35+ refuses by default),
  ``cgroupRoot`` under the caller's cgroup, ``oomScoreAdj: 0``, ``protectKernelDefaults``
  (the namespace shows the values it wants; it refuses rather than write them), x509 and
  webhook authentication and authorization of the apiserver's calls, image garbage
  collection off (images are imported, not pulled), eviction thresholds low enough for a
  shared disk.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import yaml

CONTAINERD_SOCKET = "/run/containerd/containerd.sock"
CNI_BIN_DIR = "/usr/lib/cni"


DISABLED_PLUGINS = (
    "io.containerd.internal.v1.opt",  # would create /opt/containerd on the machine
    "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
    "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs",
)


def containerd_config(*, sandbox_image: str, cni_conf_dir: Path, runc: str,
                      registry_hosts_dir: Path | None = None) -> str:
    disabled = ", ".join(f'"{p}"' for p in DISABLED_PLUGINS)
    registry = ("" if registry_hosts_dir is None else
                f"  [plugins.'io.containerd.cri.v1.images'.registry]\n"
                f"    config_path = \"{registry_hosts_dir}\"\n")
    return f"""version = 3
root = "/var/lib/containerd"
state = "/run/containerd"
disabled_plugins = [{disabled}]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[debug]
  level = "warn"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{sandbox_image}"
{registry}
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  cdi_spec_dirs = ["/etc/cdi", "/var/run/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_BIN_DIR}"]
    conf_dir = "{cni_conf_dir}"
  [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
      BinaryName = "{runc}"
      SystemdCgroup = false
"""


def registry_hosts(address: str) -> str:
    """containerd's ``hosts.toml`` for a plain-HTTP registry at ``address`` (host:port):
    resolve and pull over HTTP, no mirror, no fallback to another host."""
    return f"""server = "http://{address}"

[host."http://{address}"]
  capabilities = ["pull", "resolve"]
"""


def cni_conflist(pod_cidr: str) -> str:
    return json.dumps({
        "cniVersion": "1.0.0", "name": "rota",
        "plugins": [{
            "type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
            "ipam": {"type": "host-local", "ranges": [[{"subnet": pod_cidr}]],
                     "routes": [{"dst": "0.0.0.0/0"}]},
        }],
    }, indent=2)


def kubelet_config(*, cgroup_root: str, port: int, client_ca: Path,
                   extra: Mapping[str, object] | None = None) -> str:
    config: dict[str, object] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "failCgroupV1": False,
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
        "address": "127.0.0.1",
        "port": port,
        "readOnlyPort": 0,
        "oomScoreAdj": 0,
        "failSwapOn": False,
        "protectKernelDefaults": True,
        "authentication": {"anonymous": {"enabled": False},
                           "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(client_ca)}},
        "authorization": {"mode": "Webhook"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                         "nodefs.inodesFree": "1%", "imagefs.available": "1%"},
        "serializeImagePulls": False,
        "resolvConf": "/etc/resolv.conf",
        "maxPods": 110,
        **(extra or {}),
    }
    return yaml.safe_dump(config, sort_keys=False)
