"""Typed application keys: how the gateway's parts find each other on the application."""

from __future__ import annotations

import asyncio

from aiohttp import web

from controller.credentials import ApiKeys
from controller.gateway.dispatch import Dispatcher
from controller.gateway.metrics import GatewayMetrics
from controller.gateway.places import ModelPlaces
from controller.gateway.routing import RoutingState
from controller.gateway.settings import GatewaySettings

__all__ = ["API_KEYS", "DISPATCHER", "METRICS", "PLACES", "SETTINGS", "STATE", "STOPPING"]

SETTINGS = web.AppKey("settings", GatewaySettings)
STATE = web.AppKey("routing_state", RoutingState)
PLACES = web.AppKey("places", ModelPlaces)
METRICS = web.AppKey("metrics", GatewayMetrics)
API_KEYS = web.AppKey("api_keys", ApiKeys)
DISPATCHER = web.AppKey("dispatcher", Dispatcher)
"""Set once the shared ``ClientSession`` exists (on startup, by a cleanup context)."""
STOPPING = web.AppKey("stopping", asyncio.Event)
"""Set when the process was told to stop: /readyz fails so load balancers move away."""
