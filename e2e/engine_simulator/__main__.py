"""``python -m e2e.engine_simulator``: parse flags and environment, log JSON lines, serve."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from driver.logs import configure
from e2e.engine_simulator.app import run
from e2e.engine_simulator.settings import settings_from_args


def main(argv: Sequence[str] | None = None) -> None:
    settings = settings_from_args(argv)
    configure(settings.log_level)
    asyncio.run(run(settings))


if __name__ == "__main__":
    main()
