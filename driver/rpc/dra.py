"""The kubelet's DRA service, v1 and v1beta1, on one socket.

Translation only: protobuf requests become :class:`driver.prepare.ClaimRef` lists, the
preparer's per-claim outcomes become per-claim entries in the response. One bad claim
never fails the batch; a request the driver cannot even read (an empty uid, the same uid
twice) gets a per-claim error naming the problem. v1beta1 differs from v1 only in lacking
``share_id``.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, cast

import grpc

from driver.prepare import ClaimRef, DeviceAnswer
from rota.kit.grpc_services import generic_handler
from rota.pb.dra.v1 import api_pb2 as v1
from rota.pb.dra.v1beta1 import api_pb2 as v1beta1

log = logging.getLogger(__name__)

V1_SERVICE = v1.DESCRIPTOR.services_by_name["DRAPlugin"]
V1BETA1_SERVICE = v1beta1.DESCRIPTOR.services_by_name["DRAPlugin"]


_Context = grpc.aio.ServicerContext[Any, Any]


class Preparer(Protocol):
    async def prepare(self, claims: Sequence[ClaimRef], *, deadline: float | None = None
                      ) -> Mapping[str, Sequence[DeviceAnswer] | Exception]: ...

    async def unprepare(self, claims: Sequence[ClaimRef], *, deadline: float | None = None
                        ) -> Mapping[str, Exception | None]: ...


def _deadline(context: _Context) -> float | None:
    """The caller's deadline on the monotonic clock (the kubelet sends 45 s), if any."""
    remaining = cast(float | None, context.time_remaining())  # None without a deadline
    return None if remaining is None else time.monotonic() + remaining


def _refs(claims: Sequence[Any]) -> tuple[list[ClaimRef], dict[str, str]]:
    """Valid claim references, and an error for each unusable one (keyed by uid)."""
    counts = Counter(claim.uid for claim in claims)
    refs: list[ClaimRef] = []
    errors: dict[str, str] = {}
    for claim in claims:
        if not claim.uid:
            errors[""] = "a claim in the request has no uid"
        elif counts[claim.uid] > 1:
            errors[claim.uid] = f"claim uid {claim.uid} appears {counts[claim.uid]} times in " \
                                "one request"
        elif not claim.namespace or not claim.name:
            errors[claim.uid] = f"claim {claim.uid} lacks a namespace or a name"
        else:
            refs.append(ClaimRef(namespace=claim.namespace, uid=claim.uid, name=claim.name))
    return refs, errors


def _error_text(exc: Exception) -> str:
    return str(exc) or type(exc).__name__


class DraService:
    """Serves ``v1.DRAPlugin`` and ``v1beta1.DRAPlugin`` with one preparer."""

    def __init__(self, preparer: Preparer) -> None:
        self.preparer = preparer

    async def _prepare(self, request: Any, pb: Any, context: _Context, *,
                       with_share_id: bool) -> Any:
        refs, bad = _refs(request.claims)
        outcomes = await self.preparer.prepare(refs, deadline=_deadline(context)) if refs else {}
        response = pb.NodePrepareResourcesResponse()
        for uid, message in bad.items():
            response.claims[uid].error = message
        for ref in refs:
            entry = response.claims[ref.uid]
            outcome = outcomes.get(ref.uid)
            if outcome is None:
                entry.error = "internal error: no outcome for this claim"
            elif isinstance(outcome, Exception):
                entry.error = _error_text(outcome)
            else:
                for device in outcome:
                    d = entry.devices.add(request_names=list(device.request_names),
                                          pool_name=device.pool_name,
                                          device_name=device.device_name,
                                          cdi_device_ids=list(device.cdi_device_ids))
                    if with_share_id and device.share_id:
                        d.share_id = device.share_id
        return response

    async def _unprepare(self, request: Any, pb: Any, context: _Context) -> Any:
        refs, bad = _refs(request.claims)
        outcomes = (await self.preparer.unprepare(refs, deadline=_deadline(context))
                    if refs else {})
        response = pb.NodeUnprepareResourcesResponse()
        for uid, message in bad.items():
            response.claims[uid].error = message
        for ref in refs:
            error = outcomes.get(ref.uid)
            response.claims[ref.uid].error = _error_text(error) if error else ""
        return response

    async def prepare_v1(self, request: v1.NodePrepareResourcesRequest,
                         context: grpc.aio.ServicerContext[Any, Any]
                         ) -> v1.NodePrepareResourcesResponse:
        response: v1.NodePrepareResourcesResponse = await self._prepare(request, v1, context,
                                                                        with_share_id=True)
        return response

    async def unprepare_v1(self, request: v1.NodeUnprepareResourcesRequest,
                           context: grpc.aio.ServicerContext[Any, Any]
                           ) -> v1.NodeUnprepareResourcesResponse:
        response: v1.NodeUnprepareResourcesResponse = await self._unprepare(request, v1,
                                                                                context)
        return response

    async def prepare_v1beta1(self, request: v1beta1.NodePrepareResourcesRequest,
                              context: grpc.aio.ServicerContext[Any, Any]
                              ) -> v1beta1.NodePrepareResourcesResponse:
        response: v1beta1.NodePrepareResourcesResponse = await self._prepare(
            request, v1beta1, context, with_share_id=False)
        return response

    async def unprepare_v1beta1(self, request: v1beta1.NodeUnprepareResourcesRequest,
                                context: grpc.aio.ServicerContext[Any, Any]
                                ) -> v1beta1.NodeUnprepareResourcesResponse:
        response: v1beta1.NodeUnprepareResourcesResponse = await self._unprepare(
            request, v1beta1, context)
        return response

    def handlers(self) -> list[grpc.GenericRpcHandler[Any, Any]]:
        return [
            generic_handler(V1_SERVICE, {"NodePrepareResources": self.prepare_v1,
                                         "NodeUnprepareResources": self.unprepare_v1}),
            generic_handler(V1BETA1_SERVICE, {"NodePrepareResources": self.prepare_v1beta1,
                                              "NodeUnprepareResources":
                                                  self.unprepare_v1beta1}),
        ]
