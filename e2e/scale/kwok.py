"""kwok, Kubernetes WithOut Kubelet, managing the harness's fake GPU nodes.

One kwok process manages every Node labelled :data:`NODE_LABEL`: it renews each node's
Lease in ``kube-node-lease`` as a kubelet does (every quarter of a 40 s lease, so 6
writes per minute per node) and plays the Stages below, which are rota's own and minimal:

- ``node-initialize``: a Node that is not Ready becomes Ready and Running;
- ``node-heartbeat``: every 5 minutes (jittered) its conditions' heartbeat is written
  again, as the kubelet's status update does when nothing changed;
- ``pod-ready``: a pod bound to a managed node and not yet running becomes Running and
  Ready at once, with a pod IP from ``--cidr``. There is no DRA stage: kwok never calls a
  kubelet plugin, so nothing is prepared (the harness is about API load, not devices).

The binary comes from ``e2e/toolchain/build-kwok.sh`` (the tool cache) or ``ROTA_KWOK_BIN``.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from e2e.cluster.processes import ManagedProcess

NODE_LABEL = "rota.dev/scale-node"
BUILD_SCRIPT = Path(__file__).resolve().parent.parent / "toolchain" / "build-kwok.sh"
POD_CIDR = "10.64.0.0/10"

_NODE_CONDITIONS = """\
      conditions:
      {{ range NodeConditions }}
      - lastHeartbeatTime: {{ $now | Quote }}
        lastTransitionTime: {{ $lastTransitionTime | Quote }}
        message: {{ .message | Quote }}
        reason: {{ .reason | Quote }}
        status: {{ .status | Quote }}
        type: {{ .type | Quote }}
      {{ end }}
"""

_TEMPLATE = """\
apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  cidr: "@CIDR@"
  nodeIP: "127.0.0.1"
  nodeLeaseDurationSeconds: 40
  nodeLeaseParallelism: 4
  nodePlayStageParallelism: 4
  podPlayStageParallelism: 4
  podsOnNodeSyncParallelism: 1
  manageNodesWithLabelSelector: "@LABEL@"
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-initialize
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'NotIn'
      values: ['True']
  next:
    statusTemplate: |
      {{ $now := Now }}
      {{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
@CONDITIONS@      phase: Running
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: node-heartbeat
spec:
  resourceRef:
    apiGroup: v1
    kind: Node
  selector:
    matchExpressions:
    - key: '.status.phase'
      operator: 'In'
      values: ['Running']
    - key: '.status.conditions.[] | select( .type == "Ready" ) | .status'
      operator: 'In'
      values: ['True']
  delay:
    durationMilliseconds: 300000
    jitterDurationMilliseconds: 310000
  next:
    statusTemplate: |
      {{ $now := Now }}
      {{ $lastTransitionTime := or .metadata.creationTimestamp $now }}
@CONDITIONS@---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-ready
spec:
  resourceRef:
    apiGroup: v1
    kind: Pod
  selector:
    matchExpressions:
    - key: '.metadata.deletionTimestamp'
      operator: 'DoesNotExist'
    - key: '.status.podIP'
      operator: 'DoesNotExist'
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Initialized
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: Ready
      - lastTransitionTime: {{ $now | Quote }}
        status: "True"
        type: ContainersReady
      containerStatuses:
      {{ range .spec.containers }}
      - image: {{ .image | Quote }}
        name: {{ .name | Quote }}
        ready: true
        restartCount: 0
        started: true
        state:
          running:
            startedAt: {{ $now | Quote }}
      {{ end }}
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      {{ $pod := . }}
      podIP: {{ PodIPWith .spec.nodeName false $pod.metadata.uid $pod.metadata.name
        $pod.metadata.namespace | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
"""
CONFIG = (_TEMPLATE.replace("@CONDITIONS@", _NODE_CONDITIONS)
          .replace("@CIDR@", POD_CIDR).replace("@LABEL@", NODE_LABEL))


def locate() -> Path:
    """The kwok binary: ``ROTA_KWOK_BIN`` (a directory) or the build script's cache."""
    override = os.environ.get("ROTA_KWOK_BIN")
    if override:
        return Path(override) / "kwok"
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True,
                          check=True)
    return Path(done.stdout.strip().splitlines()[-1]) / "kwok"


def start(*, kubeconfig: Path, workdir: Path, binary: Path | None = None) -> ManagedProcess:
    """Start kwok for the cluster of ``kubeconfig``; stop it with ``.stop()``."""
    config = workdir / "kwok.yaml"
    config.write_text(CONFIG)
    exe = binary or locate()
    proc = ManagedProcess(name="kwok", argv=[
        str(exe), f"--kubeconfig={kubeconfig}", f"--config={config}",
        "--manage-all-nodes=false", f"--manage-nodes-with-label-selector={NODE_LABEL}",
    ], log_path=workdir / "logs" / "kwok.log")
    proc.start()
    return proc
