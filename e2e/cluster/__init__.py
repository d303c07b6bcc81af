"""rota's local Kubernetes: real control-plane binaries on loopback, for tests and the demo."""

from e2e.cluster.local import ClusterOptions, ClusterStartError, LocalCluster, stop_from_state
from e2e.cluster.nodes import create_node, node_body

__all__ = [
    "ClusterOptions",
    "ClusterStartError",
    "LocalCluster",
    "create_node",
    "node_body",
    "stop_from_state",
]
