"""``python -m controller.gateway``: parse settings, set up logging, serve."""

from __future__ import annotations

import asyncio
import sys

from controller.gateway import app
from controller.gateway.settings import SettingsError, load
from driver import logs


def main(argv: list[str] | None = None) -> int:
    try:
        settings = load(argv)
    except SettingsError as exc:
        print(f"rota gateway: {exc}", file=sys.stderr)
        return 2
    logs.configure(settings.log_level)
    try:
        asyncio.run(app.serve(settings))
    except app.StartupError as exc:
        print(f"rota gateway: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
