"""Typed application keys shared by the route modules."""

from __future__ import annotations

from aiohttp import web

from e2e.engine_simulator.engine import Engine

__all__ = ["ENGINE_KEY"]

ENGINE_KEY = web.AppKey("engine", Engine)
