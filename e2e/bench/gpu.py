"""GPU switch benchmark: the controller's switch protocol on one GPU (or, with
``--tensor-parallel N``, gang switches over N GPUs), WITHOUT a cluster.

    python -m e2e.bench.gpu                          # on a GPU node: real NVML, real memory
    python -m e2e.bench.gpu --fake-nvml h200         # anywhere: fake NVML, counted memory
    python -m e2e.bench.gpu --fake-nvml h200x8 --tensor-parallel 2   # a TP=2 engine

No Kubernetes is involved: no apiserver, no DRA allocation, no Lease object. What runs
for real is the rest of the path a switch takes:

- the driver's NVML backend (pynvml; ``--fake-nvml FIXTURE`` swaps in the fake) behind the
  driver's node inspection service, served on a temporary unix socket;
- engine simulators as separate processes (``python -m e2e.engine_simulator``) that hold
  real device memory (``--memory-backend cuda``; with the fake NVML they count it and
  register it), each started with ``ROTA_CLAIM_UID`` so the inspection service attributes
  its processes to a claim;
- the lease controller's :class:`~controller.lease.switch.Switcher` (and, for engines that span
  GPUs, :class:`~controller.lease.gang.GangSwitch`) with the real engine adapters, the real
  :class:`~controller.lease.device.DeviceReader` on the inspection socket, claimants built by
  hand (as the claims' opaque config would give them) and in-memory lease ports (a
  compare-and-swap on a counter instead of a Lease object, one per GPU).

One GPU (:mod:`e2e.gpu.switch_run`): the reference experiment (DESIGN.md). Both engines
start awake, the non-holder B is put to sleep first as start-up reconciliation would (its
first sleep is reported separately, as is A's, which happens in the first handoff), then N
handoffs A<->B through ``Switcher.switch``, each ending with the streamed correctness
request. Around one recovery of A the script measures output tokens/s (8 concurrent
requests x 2 rounds, 128 forced tokens with ``ignore_eos``; the simulator's
``--tokens-per-second`` sets the pace). Each level-1 wake is compared with its floor,
weight bytes divided by the host-to-device bandwidth, measured with PyTorch in a
short-lived child process (pinned host tensor to device) when torch and CUDA are present,
else taken as 54e9 B/s.

``--tensor-parallel N`` (:mod:`e2e.gpu.gang_run`): a TP=N engine A takes turns with N TP=1
engines B0..B(N-1), one per GPU, through gang switches; every GPU is read through the
inspection service every few ms to count instants with two engines awake on one GPU.

Human-readable lines while it runs; one JSON object on the last line of stdout. Every wait
has a deadline; the simulators are stopped (SIGTERM, then SIGKILL) on every exit path and
die with this process (parent-death signal) if it is killed.
"""

from __future__ import annotations

from collections.abc import Sequence

from e2e.gpu.switch_cli import main as _main

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    return _main(argv, description=__doc__)


if __name__ == "__main__":
    raise SystemExit(main())
