"""The chaos campaign: thousands of randomized switches with injected faults, against real
HTTP engine simulators, real lease controllers and gateways, and the local cluster's real
API server, with every GPU sampled every few milliseconds for two awake engines (in
awake-set mode, ``--awake-set``: for the GPU's memory in use over its total).

A benchmark, not a test (``python -m e2e.chaos --help``); ``tests/chaos`` runs a short one
of each mode.
"""
