"""``rota-engine-guard [flags] [-- engine command...]``: parse, log JSON lines, serve."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence

from controller.guard.app import run
from controller.guard.settings import load, split_command
from rota.kit.errors import ConfigError
from rota.kit.logs import configure


def main(argv: Sequence[str] | None = None) -> int:
    flags, command = split_command(sys.argv[1:] if argv is None else argv)
    try:
        settings = load(flags)
    except ConfigError as exc:
        print(f"rota-engine-guard: {exc}", file=sys.stderr)
        return 2
    configure(settings.log_level)
    try:
        return asyncio.run(run(settings, command))
    except OSError as exc:
        print(f"rota-engine-guard: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
