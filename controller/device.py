"""What is on a GPU right now, read through the driver's node inspection API, and the
pure check the switch makes before every wake."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from controller.claimants import Claimant
from driver.pb.rota.v1 import inspect_pb2 as pb
from driver.quantity import format_bytes
from driver.rpc.services import unary_client

SERVICE = pb.DESCRIPTOR.services_by_name["NodeInspection"]


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    used_bytes: int
    claim_uid: str
    pod_uid: str


@dataclass(frozen=True)
class GpuSnapshot:
    uuid: str
    device: str
    total_bytes: int
    used_bytes: int
    free_bytes: int
    processes: tuple[GpuProcess, ...]

    def used_by(self, claim_uid: str) -> int:
        return sum(p.used_bytes for p in self.processes if p.claim_uid == claim_uid)


class DeviceError(RuntimeError):
    """The inspection API did not answer."""


class DeviceReader:
    """Client of the driver's inspection socket (one channel for the process)."""

    def __init__(self, socket: Path, *, timeout_s: float = 5.0) -> None:
        self.socket = socket
        self.timeout_s = timeout_s
        self._channel: grpc.aio.Channel | None = None

    async def read(self) -> dict[str, GpuSnapshot]:
        """Every GPU of the node, by device name."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        try:
            answer: pb.InspectGpusResponse = await unary_client(
                self._channel, SERVICE, "InspectGpus")(pb.InspectGpusRequest(),
                                                       timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise DeviceError(f"inspection API at {self.socket}: {exc.code().name}: "
                              f"{exc.details()}") from exc
        return {g.device: GpuSnapshot(
            uuid=g.uuid, device=g.device, total_bytes=g.total_bytes, used_bytes=g.used_bytes,
            free_bytes=g.free_bytes,
            processes=tuple(GpuProcess(p.pid, p.used_bytes, p.claim_uid, p.pod_uid)
                            for p in g.processes)) for g in answer.gpus}

    async def verify_start_token(self, claim_uid: str, token: str) -> bool:
        """Whether ``token`` is the start-gate token the driver gave ``claim_uid``."""
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(f"unix://{self.socket}")
        try:
            answer: pb.VerifyStartTokenResponse = await unary_client(
                self._channel, SERVICE, "VerifyStartToken")(
                pb.VerifyStartTokenRequest(claim_uid=claim_uid, token=token),
                timeout=self.timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise DeviceError(f"inspection API at {self.socket}: {exc.code().name}: "
                              f"{exc.details()}") from exc
        return bool(answer.valid)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close(None)
            self._channel = None


@dataclass(frozen=True)
class HandbackProblem:
    """Why the GPU is not ready for a wake; ``reason`` is a metric label."""

    reason: str
    message: str


def check_before_wake(snapshot: GpuSnapshot, *, target: Claimant,
                      claimants: Sequence[Claimant], tolerance_bytes: int,
                      unknown_limit_bytes: int) -> HandbackProblem | None:
    """The NVML check of step 4: every other claimant is down to its resident footprint,
    no unknown process holds memory, and free memory covers the target's wake."""
    known = {c.claim_uid: c for c in claimants}
    for claimant in claimants:
        if claimant.claim_uid == target.claim_uid:
            continue
        used = snapshot.used_by(claimant.claim_uid)
        limit = claimant.resident_bytes + tolerance_bytes
        if used > limit:
            return HandbackProblem(
                "memory_not_returned",
                f"{claimant.ref} ({claimant.model}) holds {format_bytes(used)} on "
                f"{snapshot.device}, above its resident {format_bytes(claimant.resident_bytes)}"
                f" + {format_bytes(tolerance_bytes)}: its memory was not handed back")
    strangers = [p for p in snapshot.processes if p.claim_uid not in known]
    held = sum(p.used_bytes for p in strangers)
    if held > unknown_limit_bytes:
        pids = ", ".join(f"{p.pid} ({format_bytes(p.used_bytes)})" for p in strangers[:5])
        return HandbackProblem(
            "unknown_process",
            f"processes that belong to no claimant hold {format_bytes(held)} on "
            f"{snapshot.device}: {pids}")
    needed = max(0, target.config.awake_memory - snapshot.used_by(target.claim_uid))
    if needed > snapshot.free_bytes:
        return HandbackProblem(
            "insufficient_memory",
            f"{target.ref} needs {format_bytes(needed)} more to wake; {snapshot.device} has "
            f"{format_bytes(snapshot.free_bytes)} free")
    return None
