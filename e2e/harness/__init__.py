"""What builds clusters and nodes and drives scenarios on them, for tests, benchmarks,
campaigns and the demo: the simulated node of the local cluster (``local_node``), rota on
real nodes (``rota_node``, ``deploy``), the in-memory gang node, the driver's preparer over
a failing disk simulator, the Kubernetes objects, the scenarios, the one bounded wait
(``waiting``), the gateway's answers read off the wire, and the probe a tenant runs in its
pod.
"""
