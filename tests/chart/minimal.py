"""The least an install sets: the namespaces that run engines (without them, or an
explicit ``networkPolicy.enginesOpen=true``, the chart refuses to render)."""

from __future__ import annotations

ENGINE_NAMESPACE = "inference"
MINIMAL: dict[str, str] = {"engineNamespaces": f"{{{ENGINE_NAMESPACE}}}"}
"""``--set`` values of the smallest install: one engine namespace."""
