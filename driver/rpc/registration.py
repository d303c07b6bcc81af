"""The kubelet plugin registration service (``pluginregistration.Registration``).

The kubelet finds rota's socket in its plugins_registry directory, asks ``GetInfo`` and
then tells the outcome through ``NotifyRegistrationStatus``.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import grpc

from rota.kit.grpc_services import generic_handler
from rota.pb.pluginregistration import api_pb2 as reg_pb

log = logging.getLogger(__name__)

DRA_PLUGIN_TYPE = "DRAPlugin"
# Most preferred first: the kubelet takes the first entry it supports (the health service
# is chosen on its own, v1 before v1alpha1).
SUPPORTED_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin", "v1.DRAResourceHealth",
                      "v1alpha1.DRAResourceHealth")

_SERVICE = reg_pb.DESCRIPTOR.services_by_name["Registration"]


class RegistrationService:
    """Answers the kubelet's registration calls; ``registered`` is set once it accepts."""

    def __init__(self, *, driver_name: str, dra_endpoint: Path) -> None:
        self.driver_name = driver_name
        self.dra_endpoint = dra_endpoint
        self.registered = asyncio.Event()
        self.last_error = ""

    async def get_info(self, request: reg_pb.InfoRequest,
                       context: grpc.aio.ServicerContext[Any, Any]) -> reg_pb.PluginInfo:
        return reg_pb.PluginInfo(type=DRA_PLUGIN_TYPE, name=self.driver_name,
                                 endpoint=str(self.dra_endpoint),
                                 supported_versions=list(SUPPORTED_SERVICES))

    async def notify_registration_status(
            self, request: reg_pb.RegistrationStatus,
            context: grpc.aio.ServicerContext[Any, Any]) -> reg_pb.RegistrationStatusResponse:
        if request.plugin_registered:
            self.last_error = ""
            self.registered.set()
            log.info("kubelet registered the plugin", extra={"driver": self.driver_name})
        else:
            self.last_error = request.error
            self.registered.clear()
            log.error("kubelet refused the plugin",
                      extra={"driver": self.driver_name, "error": request.error[:512]})
        return reg_pb.RegistrationStatusResponse()

    def handler(self) -> grpc.GenericRpcHandler[Any, Any]:
        return generic_handler(_SERVICE, {
            "GetInfo": self.get_info,
            "NotifyRegistrationStatus": self.notify_registration_status,
        })
