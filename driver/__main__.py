"""``python -m driver`` / ``rota-driver``: parse settings, set up logging, run."""

from __future__ import annotations

import asyncio
import sys

from driver import app, logs, settings
from driver.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    try:
        config = settings.load(argv)
    except ConfigError as exc:
        print(f"rota-driver: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level)
    try:
        asyncio.run(app.run(config))
    except ConfigError as exc:
        print(f"rota-driver: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
