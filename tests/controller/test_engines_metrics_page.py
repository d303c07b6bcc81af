"""The adapter reads vLLM's gauges from a restricted metrics page, against the real
``prometheus_client`` exposition (vLLM mounts its ASGI app at ``/metrics``; the WSGI app
here shares its ``name[]`` handling): only the named metrics are rendered, and a collector
that declares no names (vLLM's multi-process collector) makes the adapter read the page
again whole instead of reporting no gauges."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from controller.engines.base import EngineEndpoint, Timeouts
from controller.engines.vllm import VllmAdapter

pytestmark = [pytest.mark.controller]

LABELS = {"model_name": "m/a", "engine": "0"}


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        """No access log on stderr."""


class _Page:
    """A metrics server on loopback that records every query string it was sent."""

    def __init__(self, registry: CollectorRegistry) -> None:
        app = make_wsgi_app(registry)
        self.queries: list[str] = []

        def recording(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
            self.queries.append(environ.get("QUERY_STRING", ""))
            result: Iterable[bytes] = app(environ, start_response)
            return result

        self.server: WSGIServer = make_server("127.0.0.1", 0, recording, handler_class=_Quiet)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture
def serve() -> Iterator[Any]:
    pages: list[_Page] = []

    def start(registry: CollectorRegistry) -> _Page:
        page = _Page(registry)
        page.thread.start()
        pages.append(page)
        return page

    yield start
    for page in pages:
        page.server.shutdown()
        page.server.server_close()


def _vllm_registry(*, running: int, waiting: int, state: str) -> CollectorRegistry:
    """vLLM's gauges with its labels, beside a histogram of many buckets, as on its page."""
    registry = CollectorRegistry()
    for name, value in (("vllm:num_requests_running", running),
                        ("vllm:num_requests_waiting", waiting)):
        Gauge(name, "requests", list(LABELS), registry=registry).labels(**LABELS).set(value)
    sleep = Gauge("vllm:engine_sleep_state", "sleep state", [*LABELS, "sleep_state"],
                  registry=registry)
    for value in ("awake", "weights_offloaded", "discard_all"):
        sleep.labels(**LABELS, sleep_state=value).set(1 if value == state else 0)
    latency = Histogram("vllm:e2e_request_latency_seconds", "latency", list(LABELS),
                        buckets=[0.001 * 2**i for i in range(40)], registry=registry)
    latency.labels(**LABELS).observe(0.5)
    return registry


class _Nameless(Collector):
    """A collector that declares no names (no ``describe``), as prometheus_client's
    multi-process collector: a restricted registry cannot find it."""

    def __init__(self, source: CollectorRegistry) -> None:
        self.source = source

    def collect(self) -> Iterable[Any]:
        for metric in self.source.collect():
            family = GaugeMetricFamily(metric.name, metric.documentation)
            family.samples = list(metric.samples)
            yield family


def _adapter(page: _Page, session: aiohttp.ClientSession) -> VllmAdapter:
    return VllmAdapter(EngineEndpoint(base_url=page.url, model="m/a", claim="ns/a"),
                       session, Timeouts())


async def test_gauges_come_from_a_page_restricted_to_them(
        serve: Any, engine_session: aiohttp.ClientSession) -> None:
    page = serve(_vllm_registry(running=2, waiting=3, state="weights_offloaded"))
    adapter = _adapter(page, engine_session)
    assert await adapter.in_flight() == 5
    assert await adapter.sleep_gauge() == "weights_offloaded"
    assert len(page.queries) == 2, page.queries
    assert all("name%5B%5D=vllm" in q or "name[]=vllm" in q for q in page.queries)


async def test_a_collector_without_names_makes_the_adapter_read_the_whole_page(
        serve: Any, engine_session: aiohttp.ClientSession) -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Nameless(_vllm_registry(running=1, waiting=0, state="awake")))
    page = serve(registry)
    adapter = _adapter(page, engine_session)
    assert await adapter.in_flight() == 1
    assert await adapter.sleep_gauge() == "awake"
    assert len(page.queries) == 4, page.queries  # each read: restricted (empty), then whole
    assert page.queries[1] == "" and page.queries[3] == ""


async def test_a_page_without_the_gauges_still_reads_as_none(
        serve: Any, engine_session: aiohttp.ClientSession) -> None:
    """vLLM with --disable-log-stats: neither page has them, nothing is invented."""
    page = serve(CollectorRegistry())
    adapter = _adapter(page, engine_session)
    assert await adapter.in_flight() is None
    assert await adapter.sleep_gauge() is None
