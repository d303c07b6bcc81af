"""python -m e2e.chaos: run a campaign and print what it counted (a JSON line last)."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import replace
from pathlib import Path

from e2e.chaos.campaign import CampaignOptions, run_campaign
from e2e.chaos.rig import RigOptions
from e2e.cluster import LocalCluster
from rota.kit.logs import configure


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m e2e.chaos",
        description="Randomized switches with injected faults on the local cluster: real "
                    "engine simulators, lease controllers, gateways and API server; every "
                    "GPU sampled every 5 ms. Prints switches, instants with two engines "
                    "awake (--awake-set: instants with a GPU's memory in use over its "
                    "total, and with more engines awake than their budgets fit), requests "
                    "without an answer, GPUs left without an owner, and failures by reason.")
    d = CampaignOptions()
    one, sets = RigOptions(), RigOptions.for_awake_set()
    p.add_argument("--switches", type=int, default=d.switches)
    p.add_argument("--max-seconds", type=float, default=d.max_seconds)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--awake-set", action="store_true",
                   help="controllers with --awake-set: several engines of a GPU awake at "
                        "once where their awake budgets fit (the defaults below change: "
                        f"{sets.engines_per_gpu} engines per GPU of {sets.awake} awake, the "
                        f"slow starter {sets.slow_awake}; any two fit an H200, no three)")
    p.add_argument("--nodes", type=int, default=one.nodes,
                   help="GPU nodes (one fake H200 each)")
    p.add_argument("--engines-per-gpu", type=int,
                   help=f"default {one.engines_per_gpu} ({sets.engines_per_gpu} with "
                        "--awake-set)")
    p.add_argument("--awake", help=f"each engine's awake budget (default {one.awake}: two "
                                   f"do not fit an H200; {sets.awake} with --awake-set)")
    p.add_argument("--slow-start-s", type=float, default=one.slow_start_s,
                   help="the last engine of each GPU starts this slowly (0: none)")
    p.add_argument("--clients-per-gpu", type=int, default=d.clients_per_gpu)
    p.add_argument("--fault-every-s", type=float, default=d.fault_every_s)
    p.add_argument("--no-faults", action="store_true", help="load only, no faults")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--keep-logs", type=Path, metavar="DIR",
                   help="copy every process's log (drivers, node agents, controllers, "
                        "gateways, engines) into DIR/<node> at the end")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure(args.log_level)
    rig = RigOptions.for_awake_set() if args.awake_set else RigOptions()
    rig = replace(rig, nodes=args.nodes, slow_start_s=args.slow_start_s,
                  engines_per_gpu=args.engines_per_gpu or rig.engines_per_gpu,
                  awake=args.awake or rig.awake)
    options = CampaignOptions(
        switches=args.switches, max_seconds=args.max_seconds, seed=args.seed,
        clients_per_gpu=args.clients_per_gpu, fault_every_s=args.fault_every_s,
        keep_logs=args.keep_logs,
        faults=() if args.no_faults else CampaignOptions().faults, rig=rig)
    with LocalCluster() as cluster:
        api = cluster.api_client()
        try:
            tally = asyncio.run(run_campaign(cluster, api, options))
        finally:
            api.close()
    for line in tally.lines():
        print(line)
    print(tally.json_line())
    return 0 if tally.clean() else 1


if __name__ == "__main__":
    sys.exit(main())
