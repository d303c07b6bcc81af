"""Which namespaces may serve which model names: the admin's binding.

A model name in a ResourceClaim is whatever its author wrote, so without a binding any
namespace that can create a claim could take a share of another team's traffic by naming
the same model. The gateway routes a model only to claimants in namespaces the admin bound
to it; a claimant anywhere else is ignored (never forwarded to, never woken).

Two sources, both the admin's:

- ``--serving-namespaces`` (comma-separated): namespaces whose claimants may serve any
  model name that the binding file does not list. Shell-style patterns work (``team-*``;
  ``*`` is every namespace, for a cluster with one tenant).
- ``--model-binding-file``: a YAML (or JSON) file, typically a mounted ConfigMap, re-read
  periodically::

      models:                   # model name (or pattern) -> the only namespaces serving it
        org/llama-70b: [prod]
        "team-a/*": [team-a]
      namespaces: [shared]      # like --serving-namespaces
      progress:                 # model name (or pattern) -> progress by default
        org/llama-70b: reasoning
        "team-a/*": none

A model that the file lists is served only from the namespaces listed for it, even when
another namespace matches ``namespaces``. With neither source set, no model is served.

``progress`` sets, per model, what a streamed chat request shows while it waits for a
switch when the request does not say (``X-Rota-Progress``): ``reasoning`` (visible progress
as ``reasoning_content``, :mod:`~controller.gateway.downstream`) or ``none`` (plain SSE
comments, the default for a model not listed). A model's exact name wins over patterns;
among patterns, the first listed that matches.
Pure, apart from :class:`BindingFile`, which reads the file off the event loop.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from controller.gateway.errors import RotaGatewayError

__all__ = ["BindingError", "BindingFile", "ModelBinding", "parse_binding"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9*?\[\]._:/@+-]{1,512}$")

Progress = Literal["reasoning", "none"]
"""What a streamed chat request waiting for a switch shows: ``reasoning`` chunks, or
``none`` (SSE comments only)."""


class BindingError(RotaGatewayError, ValueError):
    """The binding file cannot be read or does not describe a binding."""


class _File(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    models: dict[str, list[str]] = Field(default_factory=dict)
    namespaces: list[str] = Field(default_factory=list)
    progress: dict[str, Progress] = Field(default_factory=dict)


def _matches(value: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(value, pattern) for pattern in patterns)


@dataclass(frozen=True)
class ModelBinding:
    """The namespaces allowed to serve each model name."""

    namespaces: tuple[str, ...] = ()
    """Patterns of namespaces that may serve any model not in :attr:`models`."""
    models: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Model name (or pattern) -> patterns of the only namespaces that may serve it."""
    progress: dict[str, Progress] = field(default_factory=dict)
    """Model name (or pattern) -> what its waiting streamed chat requests show by
    default (see the module)."""

    def progress_of(self, model: str) -> Progress | None:
        """The progress the binding sets for ``model`` (None: it sets none)."""
        if model in self.progress:
            return self.progress[model]
        return next((shown for name, shown in self.progress.items()
                     if fnmatch.fnmatchcase(model, name)), None)

    def allows(self, model: str, namespace: str) -> bool:
        """May a claimant in ``namespace`` serve ``model``?"""
        bound = [spaces for name, spaces in self.models.items()
                 if fnmatch.fnmatchcase(model, name)]
        if bound:
            return any(_matches(namespace, spaces) for spaces in bound)
        return _matches(namespace, self.namespaces)

    def may_serve_something(self, namespace: str) -> bool:
        """Could any claimant in ``namespace`` be allowed (worth watching its pods)?"""
        return _matches(namespace, self.namespaces) or any(
            _matches(namespace, spaces) for spaces in self.models.values())

    @property
    def empty(self) -> bool:
        return not self.namespaces and not any(self.models.values())

    def with_file(self, text: str) -> ModelBinding:
        """This binding (from the settings) combined with a binding file's content.

        Raises:
            BindingError: the text is not a binding.
        """
        parsed = parse_binding(text)
        return ModelBinding(namespaces=self.namespaces + parsed.namespaces,
                            models=dict(parsed.models), progress=dict(parsed.progress))


def _checked(values: Iterable[str], where: str) -> tuple[str, ...]:
    out = []
    for value in values:
        value = value.strip()
        if not value:
            continue
        if not _NAME.match(value):
            raise BindingError(f"{where}: {value[:80]!r} is not a name or pattern")
        out.append(value)
    return tuple(out)


def parse_binding(text: str) -> ModelBinding:
    """A binding file's content (YAML or JSON) as a binding.

    Raises:
        BindingError: the text is not a binding.
    """
    try:
        raw = yaml.safe_load(text) if text.strip() else {}
    except yaml.YAMLError as exc:
        raise BindingError(f"not YAML: {exc}") from None
    try:
        parsed = _File.model_validate(raw if raw is not None else {})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'file'}: {e['msg']}"
                             for e in exc.errors()[:5])
        raise BindingError(problems) from None
    models = {name: _checked(spaces, f"models[{name!r}]")
              for name, spaces in parsed.models.items()}
    _checked(models, "models")
    _checked(parsed.progress, "progress")
    return ModelBinding(namespaces=_checked(parsed.namespaces, "namespaces"), models=models,
                        progress=dict(parsed.progress))


class BindingFile:
    """The binding of the settings, combined with a file re-read periodically."""

    def __init__(self, base: ModelBinding, path: Path | None) -> None:
        self.base = base
        self.path = path
        self.current = base

    async def load(self) -> ModelBinding:
        """Read the file now (the settings' binding alone when there is none).

        Raises:
            BindingError: the file cannot be read or is not a binding; the last good
                binding stays :attr:`current`.
        """
        if self.path is None:
            return self.current
        try:
            text = await asyncio.to_thread(self.path.read_text, encoding="utf-8")
        except OSError as exc:
            raise BindingError(f"cannot read {self.path}: {exc}") from exc
        binding = self.base.with_file(text)
        if binding != self.current:
            log.info("model binding loaded", extra={
                "path": str(self.path), "namespaces": list(binding.namespaces),
                "models": json.dumps({k: list(v) for k, v in binding.models.items()})[:1000],
                "progress": json.dumps(binding.progress)[:1000]})
        self.current = binding
        return binding
