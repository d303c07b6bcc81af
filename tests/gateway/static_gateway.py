"""A gateway process fed fixed objects instead of the Kubernetes API (shutdown tests).

``python -m tests.gateway.static_gateway <objects.json> [gateway flags]``: the JSON file
holds ``{"claims": [...], "pods": [...], "leases": [...]}``; everything else is the real
gateway, signals included.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from controller.gateway.app import make_app, serve
from controller.gateway.routing import StaticSource
from controller.gateway.settings import load
from rota.kit import logs


def main(argv: list[str]) -> int:
    objects = json.loads(Path(argv[0]).read_text())
    settings = load(argv[1:], {})
    logs.configure(settings.log_level)
    source = StaticSource(claims=objects["claims"], pods=objects["pods"],
                          leases=objects["leases"])
    asyncio.run(serve(settings, app=make_app(settings, routing_source=source)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
