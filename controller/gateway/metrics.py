"""The gateway's Prometheus metrics (prefix ``rota_gateway_``; docs/metrics.md lists them).

One :class:`GatewayMetrics` per application, on its own registry, so several gateways in
one process (tests) never share counters. ``model_name`` is the served model name (vLLM's
``model_name`` label, the ``model`` of a request). Model labels only ever carry models rota
knows:
a client's made-up model name is counted as ``(unknown)``, and the series of a model whose
last claim is gone are dropped at the next scrape (:meth:`GatewayMetrics.prune`), which
keeps the label set bounded. Queue and in-flight gauges are read from the models' places at scrape
time.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping

from prometheus_client import Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from controller.gateway.places import GateCounts
from rota.kit.metrics_registry import new_registry, package_version

__all__ = ["UNKNOWN_MODEL", "GatewayMetrics"]

UNKNOWN_MODEL = "(unknown)"

_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0,
                 40.0, 80.0, 160.0)
_FIRST_BYTE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                       10.0, 20.0, 40.0, 80.0, 160.0)


class _GateCollector(Collector):
    def __init__(self, counts: Callable[[], Mapping[str, GateCounts]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily(
            "rota_gateway_requests_running", "Requests holding a place for a model on this "
            "replica (waiting for a switch or being served).", labels=["model_name"])
        queued = GaugeMetricFamily(
            "rota_gateway_requests_queued", "Requests waiting for a place, by model.",
            labels=["model_name"])
        in_flight = GaugeMetricFamily(
            "rota_gateway_requests_in_flight", "Requests sent to an engine and not finished, "
            "by model.", labels=["model_name"])
        for model, counts in self._counts().items():
            running.add_metric([model], counts.running)
            queued.add_metric([model], counts.waiting)
            in_flight.add_metric([model], counts.in_flight)
        yield from (running, queued, in_flight)


class GatewayMetrics:
    """Every metric of one gateway application."""

    def __init__(self, gate_counts: Callable[[], Mapping[str, GateCounts]]) -> None:
        self.registry = new_registry()
        self.requests = Counter(
            "rota_gateway_requests_total", "Requests answered, by model and outcome (ok, "
            "upstream_<status>, or the gateway's error code).", ["model_name", "outcome"],
            registry=self.registry)
        self.queue_wait = Histogram(
            "rota_gateway_queue_wait_duration_seconds", "Time from a request's arrival until it "
            "is sent to an engine (queue, switch and held drains included).", ["model_name"],
            buckets=_WAIT_BUCKETS, registry=self.registry)
        self.first_byte = Histogram(
            "rota_gateway_first_byte_duration_seconds", "Time from a request's arrival to the "
            "first byte of the engine's answer sent to the client.", ["model_name"],
            buckets=_FIRST_BYTE_BUCKETS, registry=self.registry)
        self.first_token = Histogram(
            "rota_gateway_first_token_duration_seconds", "Streamed requests: time from arrival "
            "to the first chunk carrying generated text sent to the client.", ["model_name"],
            buckets=_FIRST_BYTE_BUCKETS, registry=self.registry)
        self.activations = Counter(
            "rota_gateway_activations_total", "Activation calls this replica made, by model and "
            "outcome (switched, already_awake, or the failure reason: one of a fixed set, "
            "anything else a controller says is other).", ["model_name", "outcome"],
            registry=self.registry)
        self.activation_seconds = Histogram(
            "rota_gateway_activation_duration_seconds", "Duration of activation calls (a switch "
            "when one was needed), by model and outcome.", ["model_name", "outcome"],
            buckets=_WAIT_BUCKETS, registry=self.registry)
        self.engine_refusals = Counter(
            "rota_gateway_engine_refusals_total", "Engines that did not take a request routed "
            "to them (answered 503 or could not be reached), before any byte reached the "
            "client; usually a switch this replica had not yet seen.", ["model_name", "reason"],
            registry=self.registry)
        self.upstream_retries = Counter(
            "rota_gateway_upstream_retries_total", "Requests sent again because their engine "
            "was no longer serving (it lost the GPU) before any byte reached the client.",
            ["model_name"], registry=self.registry)
        self.frozen_streams = Gauge(
            "rota_gateway_frozen_streams", "Started answers whose engine is asleep with them "
            "kept (its GPU Lease settled with another holder while they were open), by "
            "model, until the engine's next bytes.", ["model_name"], registry=self.registry)
        self.freeze_seconds = Histogram(
            "rota_gateway_stream_freeze_duration_seconds", "How long a started answer stayed "
            "frozen: from the GPU Lease showing its engine put to sleep to the engine's next "
            "bytes (or the answer's end), by model.", ["model_name"],
            buckets=_FIRST_BYTE_BUCKETS, registry=self.registry)
        self.heartbeats = Counter(
            "rota_gateway_stream_heartbeats_total", "SSE comment heartbeats written into "
            "started event streams whose engine sent nothing for --stream-heartbeat-s, by "
            "model.", ["model_name"], registry=self.registry)
        self.watch_restarts = Counter(
            "rota_gateway_watch_restarts_total", "Kubernetes watches re-opened after an "
            "error, by resource.", ["resource"], registry=self.registry)
        self.undecodable_objects = Counter(
            "rota_gateway_undecodable_objects_total", "Objects a list or watch skipped "
            "because they could not be decoded or read (nested too deep, malformed), each "
            "time one came, by resource.", ["resource"], registry=self.registry)
        self.secret_reload_failures = Counter(
            "rota_gateway_secret_reload_failures_total", "Re-reads of a mounted secret file "
            "that failed (missing, not UTF-8, a placeholder); the last good value stays in "
            "use. By file (activation_token, api_keys).", ["file"], registry=self.registry)
        for file in ("activation_token", "api_keys"):
            self.secret_reload_failures.labels(file)
        self.ignored_claimants = Gauge(
            "rota_gateway_ignored_claimants", "Claimants never routed to because the model "
            "binding does not bind their namespace to their model.", registry=self.registry)
        self.forbidden_namespaces = Gauge(
            "rota_gateway_forbidden_namespaces", "Namespaces holding rota claims whose pods "
            "this gateway may not list (403; the chart grants it pods only in "
            "engineNamespaces): their claimants get no traffic; listed again in the "
            "background.", registry=self.registry)
        self._by_model = (self.requests, self.queue_wait, self.first_byte, self.first_token,
                          self.activations, self.activation_seconds, self.engine_refusals,
                          self.upstream_retries, self.frozen_streams, self.freeze_seconds,
                          self.heartbeats)
        self.info = Gauge("rota_gateway_info", "1, labelled with the gateway's version.",
                          ["version"], registry=self.registry)
        self.info.labels(package_version()).set(1)
        self.registry.register(_GateCollector(gate_counts))

    def prune(self, known: Collection[str]) -> None:
        """Drop the series of models that no claim serves any more."""
        for metric in self._by_model:
            seen = {labels["model_name"] for family in metric.collect()
                    for sample in family.samples
                    if (labels := sample.labels).get("model_name") is not None}
            for model in seen - set(known) - {UNKNOWN_MODEL}:
                metric.remove_by_labels({"model_name": model})

    def render(self) -> bytes:
        return generate_latest(self.registry)
