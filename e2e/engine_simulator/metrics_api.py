"""``GET /metrics``: vLLM 0.26's in-flight and sleep gauges in the Prometheus text format.

A controller drains an engine before putting it to sleep by watching the engine's own
gauges, as it would on a real vLLM:

- ``vllm:num_requests_running``: generations in execution batches (a stalled or frozen
  one still counts);
- ``vllm:num_requests_waiting``: requests waiting to be scheduled;
- ``vllm:engine_sleep_state{sleep_state=awake|weights_offloaded|discard_all}``: 1 for the
  state vLLM last recorded (after a sleep call completed, after any wake call), 0 else.

As in vLLM, the in-flight values are those of the engine core's last step: requests held
while the engine is paused with nothing running, or asleep, do not show. Each carries
vLLM's labels ``model_name`` and ``engine`` (``"0"``: one engine core). With
``--disable-log-stats`` none of them is there (vLLM then has no stat logger). The
endpoint is open (never authenticated), like vLLM's.
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


def _label_value(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def render_metrics(model: str, *, running: int, waiting: int, sleep_level: int = 0) -> str:
    """The exposition text for the given counts and sleep level."""
    labels = f'engine="0",model_name="{_label_value(model)}"'
    lines: list[str] = []
    for (name, help_text), value in zip(_GAUGES, (running, waiting), strict=True):
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge",
                  f"{name}{{{labels}}} {float(value)}"]
    lines += ["# HELP vllm:engine_sleep_state Engine sleep state; awake = 0 means engine is "
              "sleeping; awake = 1 means engine is awake; weights_offloaded = 1 means sleep "
              "level 1; discard_all = 1 means sleep level 2.",
              "# TYPE vllm:engine_sleep_state gauge"]
    for level, state in enumerate(SLEEP_STATES):
        flag = 1.0 if level == sleep_level else 0.0
        lines.append(f'vllm:engine_sleep_state{{{labels},sleep_state="{state}"}} {flag}')
    return "\n".join(lines) + "\n"


async def metrics(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    if engine.settings.disable_log_stats:
        body = "# vLLM started with --disable-log-stats: no engine gauges\n"
    else:
        running, waiting = engine.gauges
        body = render_metrics(engine.settings.model, running=running, waiting=waiting,
                              sleep_level=engine.sleep_state_level)
    return web.Response(body=body.encode(), headers={"Content-Type": CONTENT_TYPE})


def metrics_routes() -> list[web.RouteDef]:
    return [web.get("/metrics", metrics)]
