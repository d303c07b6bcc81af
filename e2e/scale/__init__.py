"""The scale harness (``make scale``, ``python -m e2e.scale``): what rota asks of one API
server as the fleet grows, measured by the API server itself.

rota's local control plane (:mod:`e2e.cluster`) with an audit log; kwok keeping N fake GPU
nodes alive (:mod:`e2e.scale.kwok`); G GPUs per node published by the driver's own slice
code and E engines per GPU, allocated by the real scheduler (:mod:`e2e.scale.world`); each
node's driver and lease controller emulated from their real classes in one asyncio
process (:mod:`e2e.scale.fleet`); R real gateway processes. Phases: idle, then switching
at a set rate per GPU. Figures come from the audit log (requests by User-Agent), the API
server's ``/metrics`` (watch events and bytes, latency against the SLOs) and ``/proc``
(the gateways' RSS and CPU) (:mod:`e2e.scale.report`). Not part of ``make test``;
``tests/scale`` runs it briefly and checks only structural facts.
"""
