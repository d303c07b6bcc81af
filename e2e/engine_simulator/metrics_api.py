"""``GET /metrics``: vLLM 0.26's in-flight and sleep gauges in the Prometheus text format.

A controller drains an engine before putting it to sleep by watching the engine's own
gauges, as it would on a real vLLM:

- ``vllm:num_requests_running``: generations in execution batches (a stalled or frozen
  one still counts);
- ``vllm:num_requests_waiting``: requests waiting to be scheduled;
- ``vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}``: 1 for the
  state vLLM last recorded (after a sleep call completed, after any wake call), 0 else;
- ``vllm:num_preemptions_total`` (the counter ``vllm:num_preemptions``): requests preempted,
  here by a keep sleep or pause, counted when the request's next output is produced (after
  its recompute at the wake), as vLLM counts the PREEMPTED event.

As in vLLM, the in-flight values are those of the engine core's last step: requests held
while the engine is paused with nothing running, or asleep, do not show. Each carries
vLLM's labels ``model_name`` and ``engine`` (``"0"``: one engine core). With
``--disable-log-stats`` none of them is there (vLLM then has no stat logger). The
endpoint is open (never authenticated), like vLLM's.

The page is as large as vLLM's: every other family vLLM 0.26 exports comes too (its
request and token histograms, with vLLM's buckets), so a reader that fetches the whole
page to find three gauges pays for the rest, as on a real engine. And it is served the way
vLLM serves it: ``GET /metrics`` comes from prometheus-fastapi-instrumentator's handler,
which ignores prometheus_client's ``name[]`` filter; ``GET /metrics/...`` reaches the
Mount behind it, prometheus_client's own app, which keeps only the samples whose names
are listed in ``name[]`` (none listed: the whole page).
"""

from __future__ import annotations

from aiohttp import web

from e2e.engine_simulator.keys import ENGINE_KEY

__all__ = ["SLEEP_STATES", "metrics_routes", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")
"""``sleep_state`` label values, indexed by sleep level (0 = awake)."""


_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                    50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 4096)
_HISTOGRAMS = (
    ("vllm:request_prompt_tokens", _TOKEN_BUCKETS),
    ("vllm:request_generation_tokens", _TOKEN_BUCKETS),
    ("vllm:iteration_tokens_total", (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096,
                                     8192, 16384)),
    ("vllm:request_max_num_generation_tokens", _TOKEN_BUCKETS),
    ("vllm:request_params_n", (1, 2, 5, 10, 20)),
    ("vllm:request_params_max_tokens", _TOKEN_BUCKETS),
    ("vllm:time_to_first_token_seconds", _TTFT_BUCKETS),
    ("vllm:inter_token_latency_seconds", _TTFT_BUCKETS),
    ("vllm:request_time_per_output_token_seconds", _TTFT_BUCKETS),
    ("vllm:e2e_request_latency_seconds", _LATENCY_BUCKETS),
    ("vllm:request_queue_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_inference_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_prefill_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_decode_time_seconds", _LATENCY_BUCKETS),
    ("vllm:request_prefill_kv_computed_tokens", _TOKEN_BUCKETS),
)
"""vLLM 0.26's histograms: the names its stat logger declares, buckets of the same sizes."""
_COUNTERS = ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens",
             "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
             "vllm:request_success")


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _family(name: str, kind: str, help_text: str,
            samples: list[tuple[str, str, float]]) -> list[tuple[str, str]]:
    """(sample name, line) pairs of one family; comment lines carry the family's name."""
    lines = [(name, f"# HELP {name} {help_text}"), (name, f"# TYPE {name} {kind}")]
    return lines + [(sample, f"{sample}{{{labels}}} {value}")
                    for sample, labels, value in samples]


def render_metrics(model: str, *, running: int, waiting: int, sleep_level: int = 0,
                   preemptions: int = 0, names: frozenset[str] | None = None) -> str:
    """The exposition text for the given counts and sleep level; ``names``: keep only the
    families with a sample of one of those names (prometheus_client's ``name[]``)."""
    labels = f'engine="0",model_name="{_label_value(model)}"'
    families: list[list[tuple[str, str]]] = []
    for (name, help_text), value in zip(_GAUGES, (running, waiting), strict=True):
        families.append(_family(name, "gauge", help_text, [(name, labels, float(value))]))
    families.append(_family(
        "vllm:engine_sleep_state", "gauge", "Engine sleep state; awake = 0 means engine is "
        "sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep "
        "level 1; discard_all = 1 means sleep level 2.",
        [("vllm:engine_sleep_state", f'{labels},sleep_state="{state}"',
          1.0 if level == sleep_level else 0.0) for level, state in enumerate(SLEEP_STATES)]))
    for name in _COUNTERS:
        total = float(preemptions) if name == "vllm:num_preemptions" else 0.0
        families.append(_family(name, "counter", f"{name} (total).",
                                [(f"{name}_total", labels, total),
                                 (f"{name}_created", labels, 1.7e9)]))
    for name, buckets in _HISTOGRAMS:
        samples = [(f"{name}_bucket", f'{labels},le="{float(b)}"', 0.0) for b in buckets]
        samples += [(f"{name}_bucket", f'{labels},le="+Inf"', 0.0),
                    (f"{name}_count", labels, 0.0), (f"{name}_sum", labels, 0.0),
                    (f"{name}_created", labels, 1.7e9)]
        families.append(_family(name, "histogram", f"Histogram of {name}.", samples))
    lines: list[str] = []
    for family in families:
        kept = [(sample, line) for sample, line in family[2:]
                if names is None or sample in names]
        if kept:
            lines += [line for _, line in family[:2]] + [line for _, line in kept]
    return "\n".join(lines) + "\n" if lines else ""


def _page(request: web.Request, names: frozenset[str] | None) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.settings.disable_log_stats:
        body = "" if names else "# vLLM started with --disable-log-stats: no engine gauges\n"
    else:
        running, waiting = engine.gauges
        body = render_metrics(engine.settings.model, running=running, waiting=waiting,
                              sleep_level=engine.sleep_state_level,
                              preemptions=engine.preemptions, names=names)
    return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})


async def metrics(request: web.Request) -> web.Response:
    """vLLM's ``/metrics`` (the instrumentator's handler): every family, always."""
    return _page(request, None)


async def metrics_mount(request: web.Request) -> web.Response:
    """vLLM's ``/metrics/...`` (prometheus_client's app): ``name[]`` filters."""
    names = frozenset(request.query.getall("name[]", []))
    return _page(request, names or None)


def metrics_routes() -> list[web.RouteDef]:
    return [web.get("/metrics", metrics), web.get("/metrics/{tail:.*}", metrics_mount)]
