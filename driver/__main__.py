"""``python -m driver`` / ``rota-driver``: parse settings, set up logging, run."""

from __future__ import annotations

import asyncio
import logging
import sys

from driver import app, settings
from driver.errors import RotaDriverError
from rota.kit import kube, kube_client, logs
from rota.kit.errors import ConfigError, KitError


def main(argv: list[str] | None = None) -> int:
    try:
        config = settings.load(argv)
        kube.check_kubeconfig(config.kubeconfig)
    except ConfigError as exc:
        print(f"rota-driver: {exc}", file=sys.stderr)
        return 2
    logs.configure(config.log_level)
    kube_client.use(kube_client.ClientAgent(component="rota-driver", qps=config.api_qps,
                                            burst=config.api_burst))
    try:
        asyncio.run(app.run(config))
    except ConfigError as exc:
        print(f"rota-driver: {exc}", file=sys.stderr)
        return 2
    except (RotaDriverError, KitError) as exc:
        # E.g. a corrupt ledger: starting anyway could over-commit GPUs in use.
        logging.getLogger("driver").critical("cannot run", extra={"error": str(exc)})
        print(f"rota-driver: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
