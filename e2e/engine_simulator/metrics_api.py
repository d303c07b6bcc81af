"""``GET /metrics``: vLLM's in-flight gauges in the Prometheus text format.

A controller drains an engine before putting it to sleep by watching the engine's own
gauges, as it would on a real vLLM:

- ``vllm:num_requests_running``: generations admitted and not finished (a stalled or
  frozen one still counts);
- ``vllm:num_requests_waiting``: requests held before admission (the engine is paused, or
  asleep with ``refuse_while_asleep`` off).

Each carries vLLM's labels ``model_name`` and ``engine`` (``"0"``: one engine core). The
endpoint is open (no control credential), like vLLM's.
"""

from __future__ import annotations

from aiohttp import web

from e2e.engine_simulator.keys import ENGINE_KEY

__all__ = ["metrics_routes", "render_metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_GAUGES = (
    ("vllm:num_requests_running", "Number of requests in model execution batches."),
    ("vllm:num_requests_waiting", "Number of requests waiting to be processed."),
)


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(model: str, *, running: int, waiting: int) -> str:
    """The exposition text for the given counts."""
    labels = f'engine="0",model_name="{_label_value(model)}"'
    lines: list[str] = []
    for (name, help_text), value in zip(_GAUGES, (running, waiting), strict=True):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                  f"{name}{{{labels}}} {float(value)}"]
    return "\n".join(lines) + "\n"


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    body = render_metrics(engine.settings.model, running=engine.running,
                          waiting=engine.waiting)
    return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})


def metrics_routes() -> list[web.RouteDef]:
    return [web.get("/metrics", metrics)]
