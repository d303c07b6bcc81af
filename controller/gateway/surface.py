"""The gateway's HTTP surface against vLLM's: what is routed, and what is refused why.

Every route of vLLM 0.26's server (read from the real wheel by ``e2e/tools/vllm_routes.py``
into ``controller/gateway/vllm_routes.json``; ``tests/gateway/test_vllm_routes.py`` checks
this module against that table), and every model-bearing route of each later supported
release (their tables are ``controller/lease/engines/vllm_surfaces``, checked by
``tests/controller/test_engine_surfaces.py``), is one of:

- **routed** (:data:`ROUTED`, defined with the engine guard in
  :mod:`rota.api.client_routes`): each route whose request names a ``model`` goes, with the
  same places, queueing and switching, to the same path on the engine that holds the
  model's GPU. The model is read from the JSON body's ``model`` field, or, for the audio
  uploads (``multipart/form-data``), from the form's ``model`` field; ``stream`` the same
  way. Only the routes marked ``streams`` may answer an event stream (and so may have their
  answer started early while a switch runs); ``/v1/messages`` speaks Anthropic's dialect,
  so an error inside its stream is an ``event: error`` as vLLM sends it. Each route says
  the first release that serves it (:attr:`Routed.since`, :func:`routed_for`); the gateway
  does not know which release each engine runs, so a route newer than the engine is
  answered by the engine's own 404.
- **the gateway's own** (:data:`OWN`): ``GET /v1/models`` (the fleet's models) and
  ``GET /readyz`` (the gateway's readiness), served by the gateway itself.
- **refused** (:data:`REFUSED`): a 404 in the OpenAI error shape (``code:
  route_not_routed``) naming the route and the reason: engines' control calls above all
  (only the node's lease controller may put an engine to sleep), and routes that name no
  model. Nothing is ever proxied by pattern, so no control call can slip through.

Pure: no I/O, no aiohttp.
"""

from __future__ import annotations

import re

from rota.api.client_routes import ROUTED, Dialect, Routed

__all__ = ["OWN", "REFUSED", "ROUTED", "Dialect", "Routed", "routed", "routed_for"]

OWN: dict[tuple[str, str], str] = {
    ("GET", "/v1/models"): "the gateway lists the fleet's models itself, with their state",
    ("GET", "/readyz"): "the gateway's own readiness",
}
"""vLLM's routes the gateway answers itself (method, path) -> what it answers."""

_CONTROL = ("an engine's control call: only rota's lease controller drives engines; the "
            "gateway never passes one on")
_ENGINE = ("a question about one engine that names no model; the gateway's own health is "
           "/healthz and /readyz, the fleet's models are /v1/models")
_ADMIN = ("changes what one engine serves: an operator's call to that engine, not a "
          "client's")

REFUSED: dict[tuple[str, str], str] = {
    **{("POST", path): _CONTROL for path in (
        "/sleep", "/wake_up", "/collective_rpc", "/reset_prefix_cache", "/reset_mm_cache",
        "/reset_encoder_cache", "/pause", "/resume", "/abort_requests",
        "/init_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
        "/update_weights", "/finish_weight_update", "/scale_elastic_ep",
        "/is_scaling_elastic_ep", "/start_profile", "/stop_profile")},
    **{("GET", path): _CONTROL for path in ("/is_sleeping", "/is_paused", "/get_world_size")},
    **{("GET", path): _ENGINE for path in (
        "/health", "/ready", "/load", "/version", "/server_info", "/tokenizer_info", "/docs",
        "/ping")},
    ("POST", "/ping"): _ENGINE,
    ("POST", "/v1/load_lora_adapter"): _ADMIN,
    ("POST", "/v1/unload_lora_adapter"): _ADMIN,
    ("POST", "/invocations"): ("SageMaker's entry point, which picks the API by the body's "
                               "shape: send the request to the route it stands for "
                               "(/v1/chat/completions, /v1/embeddings, ...)"),
    ("GET", "/v1/responses/{response_id}"): (
        "names no model: a stored response lives in the one engine that made it, which may "
        "be asleep or on another node; send the conversation again to /v1/responses"),
    ("POST", "/v1/responses/{response_id}/cancel"): (
        "names no model: a background response lives in the one engine that made it; "
        "rota does not track where"),
    ("WEBSOCKET", "/v1/realtime"): ("a WebSocket session: the gateway proxies HTTP "
                                    "requests only"),
}
"""vLLM's routes the gateway refuses: (method, path) -> why (said in the 404)."""

_BY_PATH = {route.path: route for route in ROUTED}


def routed(path: str) -> Routed | None:
    """The routed route at ``path`` (None: not routed)."""
    return _BY_PATH.get(path)


_RELEASE = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def _release(version: str) -> tuple[int, int, int]:
    found = _RELEASE.match(version.strip())
    if not found:
        raise ValueError(f"not a vLLM release: {version!r}")
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


def routed_for(version: str) -> tuple[Routed, ...]:
    """The routed routes vLLM ``version`` serves: those not newer than it (``0.34.0``,
    ``0.33.1.dev12`` and ``0.34.0+cu130`` are read as releases are)."""
    release = _release(version)
    return tuple(route for route in ROUTED if _release(route.since) <= release)
