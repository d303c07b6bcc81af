"""Settings plumbing every rota process uses: one ``--flag`` and one environment variable
per field of a pydantic model, parsed once at start.

Flags win over environment variables, which win over defaults; the flag is
``--<field-with-dashes>`` and the variable ``ROTA_<FIELD>`` (``NODE_NAME`` and ``POD_UID``
too, as the downward API usually sets them). A bad value is a :class:`ConfigError` naming
every problem, which each process's entry point prints as one line (exit 2).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from rota.kit.errors import ConfigError
from rota.kit.kube_client import version

__all__ = ["LogLevel", "build_parser", "env_names", "parse_settings"]

LogLevel = Literal["debug", "info", "warning", "error"]
"""The log levels every rota process takes; anything else is a settings error (exit 2),
not a traceback from the logging module."""


_ENV_ALIASES = {"node_name": ("NODE_NAME",), "pod_uid": ("POD_UID",)}


def env_names(field: str, prefix: str = "ROTA_") -> tuple[str, ...]:
    return (prefix + field.upper(), *_ENV_ALIASES.get(field, ()))


def build_parser(model: type[BaseModel], prog: str, description: str, *,
                 env_prefix: str = "ROTA_") -> argparse.ArgumentParser:
    """One ``--flag`` per field of ``model``; help = description, env var and default.

    ``prog`` is the name the user typed (the installed script, with its command): usage,
    errors and ``--version`` all say it, so a user never sees a module path."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"{prog} {version()}")
    for name, info in model.model_fields.items():
        default = "" if info.is_required() or info.default_factory else \
            f"Default: {info.default}."
        envs = " or ".join(env_names(name, env_prefix))
        text = " ".join(part for part in (info.description, f"Env: {envs}.", default) if part)
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None, help=text)
    return parser


def parse_settings(model: type[BaseModel], argv: Sequence[str] | None,
                   environ: Mapping[str, str] | None, *, prog: str, description: str,
                   env_prefix: str = "ROTA_") -> Any:
    """Flags win over environment variables, which win over defaults.

    Raises:
        ConfigError: the values do not validate; the message names every problem.
    """
    environ = os.environ if environ is None else environ
    args = vars(build_parser(model, prog, description, env_prefix=env_prefix)
                .parse_args(argv))
    values: dict[str, Any] = {}
    for name in model.model_fields:
        if args.get(name) is not None:
            values[name] = args[name]
            continue
        for env in env_names(name, env_prefix):
            if environ.get(env):
                values[name] = environ[env]
                break
    for name, value in list(values.items()):
        annotation = model.model_fields[name].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            try:
                values[name] = json.loads(value)
            except ValueError as exc:
                raise ConfigError(f"invalid settings: {name}: not a JSON object") from exc
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
                             for e in exc.errors())
        raise ConfigError(f"invalid settings: {problems}") from exc
