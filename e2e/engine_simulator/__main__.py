"""``python -m e2e.engine_simulator``: parse flags and environment, log JSON lines, serve.

An engine whose memory does not fit on the GPU at start exits with status 1 after logging
vLLM's messages (``torch.OutOfMemoryError ... CUDA out of memory``, ``Engine core
initialization failed``), as vLLM's API server does.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Sequence

from e2e.engine_simulator.app import run
from e2e.engine_simulator.engine import StartFailed
from e2e.engine_simulator.settings import settings_from_args
from rota.kit.logs import configure

log = logging.getLogger("e2e.engine_simulator")


def main(argv: Sequence[str] | None = None) -> None:
    settings = settings_from_args(argv)
    configure(settings.log_level)
    try:
        asyncio.run(run(settings))
    except StartFailed as exc:
        log.critical(f"RuntimeError: {exc}", extra={"model": settings.model, "exit_code": 1})
        sys.exit(1)


if __name__ == "__main__":
    main()
