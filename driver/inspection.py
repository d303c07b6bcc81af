"""The node inspection API: what is on each GPU right now.

The lease controller calls it before every wake. Each call reads NVML afresh (memory and
compute processes take microseconds) and reports, for every process, the pod the kernel
puts it in (its cgroup, :mod:`driver.cgroups`) and the claim it names itself: the
``ROTA_CLAIM_UID`` that rota's CDI spec put in the engine's environment. The pod is the
fact; the claim uid is the process's word, which any process can forge. It is reported
only for a process in a pod, and the controller counts a process as a claimant's only when
it runs in the pod the claim is reserved for (``controller.lease.device.owner_of``). A process in
no pod names no claim: memory held by something that is not a claimant.

``ROTA_POD_UID`` from a process's environment is never taken as its pod, except where the
driver is told to (``pods_from_environment``: the fake NVML backend, whose simulated
engines run outside any pod cgroup, or inside the cgroup of whatever pod the whole
simulation runs in). There a process's ``ROTA_POD_UID`` wins, the cgroup's pod serving
only processes that name none.

``VerifyStartToken`` tells the controller whether a start-gate token is a claim's own
(:mod:`driver.startgate`); ``ControlToken`` gives it the control token of one claim
(:mod:`driver.control_tokens`), which it sends to that claim's engine only. The key never
leaves the driver; the socket is mounted into the lease controller alone (mode 0660, its
directory read-only), so a claim's token reaches only its own containers (CDI) and the
controller.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from driver import metrics
from driver.cgroups import pod_of_pid
from driver.control_tokens import ControlTokens
from driver.devices import GpuDevice
from driver.errors import NvmlError
from driver.nvml.api import NvmlBackend
from driver.startgate import StartGate
from rota.kit.grpc_services import generic_handler
from rota.pb.rota.v1 import inspect_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["NodeInspection"]
_ENV_KEYS = (b"ROTA_CLAIM_UID", b"ROTA_POD_UID")


def process_environment(pid: int, proc_root: Path) -> dict[str, str]:
    """The ``ROTA_CLAIM_UID`` / ``ROTA_POD_UID`` of a process, where readable."""
    try:
        with open(f"{proc_root}/{pid}/environ", "rb") as file:  # plain string: read often
            raw = file.read()
    except OSError:
        return {}
    found: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, _, value = item.partition(b"=")
        if key in _ENV_KEYS:
            found[key.decode()] = value.decode(errors="replace")
    return found


class InspectionService:
    """Serves ``rota.v1.NodeInspection`` from an NVML backend."""

    def __init__(self, *, backend: NvmlBackend, gpus: list[GpuDevice], proc_root: Path,
                 pods_from_environment: bool = False,
                 start_gate: StartGate | None = None,
                 control: ControlTokens | None = None) -> None:
        """``pods_from_environment``: take a process's ``ROTA_POD_UID`` as its pod. Only for
        simulated nodes (the fake NVML backend): any process can set its environment."""
        self.backend = backend
        self.gpus = gpus
        self.proc_root = proc_root
        self.pods_from_environment = pods_from_environment
        self.start_gate = start_gate
        self.control = control

    def read(self, uuids: set[str]) -> pb.InspectGpusResponse:
        """One blocking NVML read of the selected GPUs (all when ``uuids`` is empty)."""
        response = pb.InspectGpusResponse(read_at=time.time())
        for gpu in self.gpus:
            if uuids and gpu.uuid not in uuids:
                continue
            memory, processes = self.backend.memory_and_processes(gpu.index)
            state = response.gpus.add(uuid=gpu.uuid, device=gpu.name, total_bytes=memory.total,
                                      used_bytes=memory.used, free_bytes=memory.free)
            for proc in processes:
                pod = pod_of_pid(proc.pid, self.proc_root)
                env = process_environment(proc.pid, self.proc_root)
                pod_uid = pod.pod_uid if pod else ""
                if self.pods_from_environment:
                    pod_uid = env.get("ROTA_POD_UID") or pod_uid
                state.processes.add(
                    pid=proc.pid, used_bytes=proc.used_bytes or 0,
                    used_bytes_unknown=proc.used_bytes is None, pod_uid=pod_uid,
                    container_id=(pod.container_id or "") if pod else "",
                    claim_uid=env.get("ROTA_CLAIM_UID", "") if pod_uid else "")
        return response

    async def inspect(self, request: pb.InspectGpusRequest,
                      context: grpc.aio.ServicerContext[Any, Any]) -> pb.InspectGpusResponse:
        wanted = set(request.gpu_uuids)
        unknown = wanted - {gpu.uuid for gpu in self.gpus}
        if unknown:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"no GPU with uuid {', '.join(sorted(unknown))} on this node")
        with metrics.observe("inspect") as outcome:
            try:
                return await asyncio.to_thread(self.read, wanted)
            except NvmlError as exc:
                outcome.reason = exc.reason
                metrics.NVML_ERRORS.labels(exc.reason).inc()
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"NVML: {exc}")
        raise AssertionError("unreachable")

    async def verify_start_token(self, request: pb.VerifyStartTokenRequest,
                                 context: grpc.aio.ServicerContext[Any, Any]
                                 ) -> pb.VerifyStartTokenResponse:
        gate = self.start_gate
        valid = gate is not None and gate.verify(request.claim_uid, request.token)
        if not valid:
            log.warning("start-gate token refused", extra={"claim": request.claim_uid[:64]})
        return pb.VerifyStartTokenResponse(valid=valid)

    async def control_token(self, request: pb.ControlTokenRequest,
                            context: grpc.aio.ServicerContext[Any, Any]
                            ) -> pb.ControlTokenResponse:
        if self.control is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "this driver derives no control tokens")
            raise AssertionError("unreachable")
        if not request.claim_uid:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "claim_uid is empty")
        log.info("control token handed to the lease controller",
                 extra={"claim": request.claim_uid[:64]})
        return pb.ControlTokenResponse(token=self.control.token(request.claim_uid))

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return generic_handler(SERVICE, {"InspectGpus": self.inspect,
                                         "VerifyStartToken": self.verify_start_token,
                                         "ControlToken": self.control_token})
