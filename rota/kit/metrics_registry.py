"""What every rota component's Prometheus registry carries, one home for the three of them.

Each component (the driver, the lease controller, a gateway application) has a registry of
its own; :func:`new_registry` adds the standard collectors to it (``process_*``,
``python_info``, ``python_gc_*``), and :func:`package_version` is the version its
``rota_<component>_info`` gauge reports: the installed ``rota`` package's, as
``importlib.metadata`` reads it.
"""

from __future__ import annotations

from functools import cache
from importlib import metadata

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector

__all__ = ["PACKAGE", "UNKNOWN_VERSION", "new_registry", "package_version"]

PACKAGE = "rota"
UNKNOWN_VERSION = "unknown"
"""The version reported when the package is not installed (source tree on ``sys.path``)."""


@cache
def package_version() -> str:
    """The installed rota package's version."""
    try:
        return metadata.version(PACKAGE)
    except metadata.PackageNotFoundError:
        return UNKNOWN_VERSION


def new_registry() -> CollectorRegistry:
    """A registry with the process, platform and garbage-collector collectors on it."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    GCCollector(registry=registry)  # registers itself only where CPython has gc stats
    return registry
