"""Bind gRPC services to coroutines straight from the generated descriptors.

rota generates only message classes from ``proto/``; a service is served by naming its
descriptor and giving one coroutine per method. The full method names therefore come
from the ``.proto`` package and service, exactly as the kubelet dials them, and a typo
in a method name fails at start-up rather than at the first call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

UnaryHandler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Awaitable[Message]]
StreamHandler = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], AsyncIterator[Message]]


def method_path(service: ServiceDescriptor, method: str) -> str:
    """``/<package>.<Service>/<Method>``, the name on the wire."""
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


async def _parse(raw: bytes, request_cls: type[Message],
                 context: grpc.aio.ServicerContext[Any, Any]) -> Message:
    """Parse a request; a malformed one is answered INVALID_ARGUMENT, naming the type."""
    try:
        return request_cls.FromString(raw)
    except DecodeError as exc:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"malformed {request_cls.DESCRIPTOR.full_name}: {exc}")
        raise  # abort raises; this only satisfies the type checker


def _parsing_unary(handler: UnaryHandler, request_cls: type[Message]) -> UnaryHandler:
    async def parse_then_handle(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
                                ) -> Message:
        return await handler(await _parse(raw, request_cls, context), context)

    return parse_then_handle


def _parsing_stream(handler: StreamHandler, request_cls: type[Message]) -> StreamHandler:
    async def parse_then_stream(raw: bytes, context: grpc.aio.ServicerContext[Any, Any]
                                ) -> AsyncIterator[Message]:
        async for item in handler(await _parse(raw, request_cls, context), context):
            yield item

    return parse_then_stream


def generic_handler(service: ServiceDescriptor,
                    handlers: Mapping[str, UnaryHandler | StreamHandler]
                    ) -> grpc.GenericRpcHandler[Any, Any]:
    """A handler serving ``service`` with ``handlers`` (method name -> coroutine).

    Every method of the service must be given, and nothing else.
    """
    names = set(service.methods_by_name)
    if set(handlers) != names:
        raise ValueError(f"{service.full_name}: handlers for {sorted(handlers)}, "
                         f"service has {sorted(names)}")
    rpc_handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for name, method in service.methods_by_name.items():
        request_cls = GetMessageClass(method.input_type)
        response_cls = GetMessageClass(method.output_type)
        if method.client_streaming:
            raise ValueError(f"{service.full_name}/{name}: client streaming is not used")
        if method.server_streaming:
            rpc_handlers[name] = grpc.unary_stream_rpc_method_handler(
                _parsing_stream(handlers[name], request_cls),  # type: ignore[arg-type]
                response_serializer=response_cls.SerializeToString)
        else:
            rpc_handlers[name] = grpc.unary_unary_rpc_method_handler(
                _parsing_unary(handlers[name], request_cls),  # type: ignore[arg-type]
                response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, rpc_handlers)


def unary_client(channel: grpc.aio.Channel, service: ServiceDescriptor, method: str
                 ) -> grpc.aio.UnaryUnaryMultiCallable[Any, Any]:
    """A client stub for one unary method, built from the descriptor."""
    m = service.methods_by_name[method]
    return channel.unary_unary(
        method_path(service, method),
        request_serializer=GetMessageClass(m.input_type).SerializeToString,
        response_deserializer=GetMessageClass(m.output_type).FromString,
    )


def stream_client(channel: grpc.aio.Channel, service: ServiceDescriptor, method: str
                  ) -> grpc.aio.UnaryStreamMultiCallable[Any, Any]:
    """A client stub for one server-streaming method, built from the descriptor."""
    m = service.methods_by_name[method]
    return channel.unary_stream(
        method_path(service, method),
        request_serializer=GetMessageClass(m.input_type).SerializeToString,
        response_deserializer=GetMessageClass(m.output_type).FromString,
    )
