"""``python -m e2e.images``: build (or find cached) rota's images and print what was built."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from e2e.images import PAUSE_IMAGE, ROTA_IMAGE, SIMULATOR_IMAGE, build_images
from rota.kit.logs import configure

REPO = Path(__file__).resolve().parent.parent.parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m e2e.images",
        description="Build rota's pause, rota and engine-simulator images from this "
                    "repository into an OCI archive (cached by content); print a JSON summary.")
    parser.add_argument("--rota-name", action="append", default=[],
                        help=f"name of rota's image (repeatable; default {ROTA_IMAGE})")
    parser.add_argument("--simulator-name", action="append", default=[],
                        help=f"name of the simulator's image (default {SIMULATOR_IMAGE})")
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    configure(args.log_level)
    built = build_images(REPO, rota_names=args.rota_name or [ROTA_IMAGE],
                         simulator_names=args.simulator_name or [SIMULATOR_IMAGE],
                         pause_name=PAUSE_IMAGE)
    print(built.model_dump_json(indent=2))
    print(f"size of all layers: {built.size_bytes / 2**20:.1f} MiB", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
