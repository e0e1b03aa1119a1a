"""A gRPC client that knows nothing but the server's address, as grpcurl: it learns the services and
their messages through server reflection and calls methods by name with JSON bodies."""
from __future__ import annotations

import grpc
from google.protobuf import descriptor_pool, json_format, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase


class DynamicClient:
    """Everything it knows comes from reflection; it never imports the generated stubs."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.db = ProtoReflectionDescriptorDatabase(channel)
        self.pool = descriptor_pool.DescriptorPool(self.db)

    def services(self) -> list[str]:
        return list(self.db.get_services())

    def method(self, full_name: str):
        service, name = full_name.rsplit(".", 1)
        return self.pool.FindServiceByName(service).methods_by_name[name]

    def call(self, full_name: str, body: dict, timeout: float = 120):
        """Like `grpcurl -d '<json>' addr full_name`: JSON in, a list of JSON objects out."""
        method = self.method(full_name)
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        path = f"/{method.containing_service.full_name}/{method.name}"
        request = json_format.ParseDict(body, request_cls())
        kind = self.channel.unary_stream if method.server_streaming else self.channel.unary_unary
        rpc = kind(path, request_serializer=request_cls.SerializeToString,
                   response_deserializer=response_cls.FromString)
        result = rpc(request, timeout=timeout)
        responses = list(result) if method.server_streaming else [result]
        return [json_format.MessageToDict(r) for r in responses]
