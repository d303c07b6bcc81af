"""Adapter name to adapter: the one place that knows which engines rota can drive.

The claim's opaque config names its adapter (``vllm``, ``vllm-omni``, ``http``), the
adapter-specific settings (``omniStageIds``, ``http``) and the probe (``probe``);
:func:`make_adapter` turns that into an :class:`~controller.lease.engines.base.EngineAdapter` on
the controller's session. The engine's API key travels in the endpoint
(``EngineEndpoint.api_key``), read by the caller from the Secret ``apiKeySecret`` names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import aiohttp

from controller.lease.engines.base import EngineAdapter, EngineEndpoint, Timeouts
from controller.lease.engines.http import HttpAdapter
from controller.lease.engines.vllm import VllmAdapter
from controller.lease.engines.vllm_omni import VllmOmniAdapter
from rota.api.engine_config import EngineConfig

__all__ = ["ADAPTERS", "AdapterFactory", "make_adapter"]

AdapterFactory = Callable[
    [EngineConfig, EngineEndpoint, aiohttp.ClientSession, Timeouts], EngineAdapter
]


def _vllm(
    config: EngineConfig, endpoint: EngineEndpoint, session: aiohttp.ClientSession,
    timeouts: Timeouts,
) -> EngineAdapter:
    return VllmAdapter(endpoint, session, timeouts, probe=config.probe)


def _vllm_omni(
    config: EngineConfig, endpoint: EngineEndpoint, session: aiohttp.ClientSession,
    timeouts: Timeouts,
) -> EngineAdapter:
    if config.omni_stage_ids is None:
        raise ValueError("adapter vllm-omni needs omniStageIds in the claim's config")
    return VllmOmniAdapter(endpoint, session, timeouts, stage_ids=config.omni_stage_ids,
                           probe=config.probe)


def _http(
    config: EngineConfig, endpoint: EngineEndpoint, session: aiohttp.ClientSession,
    timeouts: Timeouts,
) -> EngineAdapter:
    return HttpAdapter(endpoint, session, timeouts, config=config.http, probe=config.probe)


ADAPTERS: Mapping[str, AdapterFactory] = {
    "vllm": _vllm,
    "vllm-omni": _vllm_omni,
    "http": _http,
}
"""Every adapter name the opaque config may give, with its constructor."""


def make_adapter(
    config: EngineConfig,
    endpoint: EngineEndpoint,
    session: aiohttp.ClientSession,
    timeouts: Timeouts,
) -> EngineAdapter:
    """The adapter ``config.adapter`` names; ValueError for a name this release lacks."""
    try:
        factory = ADAPTERS[config.adapter]
    except KeyError:
        raise ValueError(
            f"unknown engine adapter {config.adapter!r}; known: {', '.join(ADAPTERS)}"
        ) from None
    return factory(config, endpoint, session, timeouts)
