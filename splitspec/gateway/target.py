"""The gateway's one connection to `splitspec-target`: the public Generation API and
grpc.health.v1, over a grpc.aio channel."""

from __future__ import annotations

import json

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitspec.channel import open_aio_channel
from splitspec.v1 import generation_pb2 as pb
from splitspec.v1 import generation_pb2_grpc as pb_grpc

REQUEST_ID_METADATA = "splitspec-request-id"  # the target's initial metadata once it admitted a request
# round_robin: with a dns:/// name that resolves to every target replica (a headless
# Service), calls spread over all of them; with one address it is the same as pick_first.
SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


class TargetClient:
    def __init__(self, address: str, tls_ca: str | None, max_message_bytes: int) -> None:
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.service_config", SERVICE_CONFIG), ("grpc.enable_retries", 0)]
        self.address = address
        self._channel = open_aio_channel(address, tls_ca, options)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self._model_info: pb.ModelInfo | None = None

    async def close(self) -> None:
        await self._channel.close()

    async def start(self, request: pb.GenerateRequest, timeout: float | None = None):
        """A Generate call the target has admitted (it sent its request-id metadata);
        AioRpcError when it refused the request (bad field, queue full, unavailable).
        `timeout`: the call's deadline in seconds (None: none)."""
        call = self._stub.Generate(request, timeout=timeout)
        try:
            metadata = await call.initial_metadata()
            if metadata is None or REQUEST_ID_METADATA not in metadata.keys():
                await call.read()  # a refused call has no messages: this raises its status
                raise grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           "the target answered without admitting the request")
        except BaseException:
            call.cancel()
            raise
        return call

    async def model_info(self, refresh: bool = False) -> pb.ModelInfo:
        if self._model_info is None or refresh:
            self._model_info = await self._stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
        return self._model_info

    async def health(self, timeout: float) -> str:
        """The target's grpc.health.v1 status name, or the gRPC error code's name."""
        try:
            reply = await self._health.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
