"""``python -m e2e.scale``: run the scale harness and print a line per phase, JSON last."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from e2e.scale.report import phase_line
from e2e.scale.run import Options, run


def parse(argv: list[str] | None = None) -> Options:
    defaults = Options()
    p = argparse.ArgumentParser(
        prog="python -m e2e.scale",
        description="rota's API load at N kwok GPU nodes, measured by the API server: "
                    "an idle phase, then switching at a set rate per GPU.")
    p.add_argument("--nodes", type=int, default=defaults.nodes, help="GPU nodes (N).")
    p.add_argument("--gpus", type=int, default=defaults.gpus, help="GPUs per node (G).")
    p.add_argument("--engines", type=int, default=defaults.engines,
                   help="Engines (claims and pods) per GPU (E).")
    p.add_argument("--idle-s", type=float, default=defaults.idle_s,
                   help="Length of the idle phase.")
    p.add_argument("--switch-s", type=float, default=defaults.switch_s,
                   help="Length of the switching phase.")
    p.add_argument("--switches-per-gpu-hour", type=float,
                   default=defaults.switches_per_gpu_hour,
                   help="Switches asked of each GPU per hour while switching (on average).")
    p.add_argument("--gateways", type=int, default=defaults.gateways,
                   help="Gateway processes (replicas).")
    p.add_argument("--engine-s", type=float, default=defaults.engine_s,
                   help="How long each engine step of a switch takes (no API call).")
    p.add_argument("--reconcile-s", type=float, default=defaults.reconcile_s,
                   help="How long a reconciliation takes besides its Lease read (no API "
                        "call: engines asked, GPU read).")
    p.add_argument("--settle-s", type=float, default=defaults.settle_s,
                   help="Pause between start-up and the first phase.")
    p.add_argument("--restart-s", type=float, default=defaults.restart_s,
                   help="After switching, a phase of this length that begins with an API "
                        "server restart (relists per component are counted); 0: none.")
    p.add_argument("--seed", type=int, default=defaults.seed, help="Seed of the switches.")
    p.add_argument("--workdir", type=Path, default=None,
                   help="Keep logs and the audit log here (a temporary directory, removed "
                        "at the end, when unset).")
    a = p.parse_args(argv)
    return Options(nodes=a.nodes, gpus=a.gpus, engines=a.engines, idle_s=a.idle_s,
                   switch_s=a.switch_s, switches_per_gpu_hour=a.switches_per_gpu_hour,
                   gateways=a.gateways, engine_s=a.engine_s, reconcile_s=a.reconcile_s,
                   settle_s=a.settle_s,
                   restart_s=a.restart_s, seed=a.seed, workdir=a.workdir)


def main(argv: list[str] | None = None) -> int:
    options = parse(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Many clients share few pooled connections in one process; the pool says so each time.
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
    result = run(options)
    for name, figures in result["phases"].items():
        print(phase_line(name, figures), flush=True)
    print(json.dumps(result, indent=None, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
