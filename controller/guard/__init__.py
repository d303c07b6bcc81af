"""rota's engine guard: an authenticating proxy in front of one engine, in its pod.

vLLM authenticates only ``/v1*`` (``--api-key``); its sleep and control routes answer
anyone who reaches its port. The guard closes that gap without relying on a NetworkPolicy:
vLLM listens on loopback only, and the guard, on the pod's port, exposes

- the OpenAI surface (``/v1*``, ``/tokenize``, ``/detokenize``), checking the engine's API
  key when one is configured (``Authorization: Bearer``, as vLLM does);
- rota's control calls (``/sleep``, ``/wake_up``, ``/is_sleeping``, ``/collective_rpc``,
  ``/reset_prefix_cache``, ``/metrics``, ``/v1/omni/*``), checking the claim's own control
  token (header ``X-Rota-Control-Token``; the value the driver wrote into the guard's
  environment, ``ROTA_CONTROL_TOKEN``: one per claim, so what one engine learns opens no
  other);
- ``/health``, open (kubelet probes);

and nothing else (``/pause``, ``/resume``, ``/abort_requests``, weight-update routes, ...
answer 404). Streams pass through unbuffered; request bodies are bounded; every upstream
call has a connect timeout and a read timeout (control calls also a total one).

It runs as a sidecar (``rota-engine-guard --upstream http://127.0.0.1:8001``) or as the
engine container's entrypoint wrapper (``rota-engine-guard [flags] -- vllm serve ...
--host 127.0.0.1 --port 8001``: it starts the engine, forwards SIGTERM, and exits with the
engine's status). The project's README, section "Engine guard", shows both.
"""
