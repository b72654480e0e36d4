"""gRPC client of the replicas' entry stages, with load balancing and failover.

Contract:
- ``ReplicaClient(mesh, ...)`` keeps one ``grpc.aio`` channel per entry-stage target, created on first use in
  the running event loop; ``close()`` closes them all. Every call carries the mesh token
  (``stagemesh_core.mesh_token``); with ``tls`` the channels are mutual TLS (``stagemesh_core.grpc_tls``).
- ``generate(request, affinity=None)`` is an async generator of ``GenerateResponse`` messages from one
  routable replica chosen by ``gateway.mesh.balancer``, under a per-request deadline, over the entry stage's shared
  ``GenerateStream`` call (``gateway.mesh.stage_streams``). Closing the generator or cancelling its consumer
  cancels the request, so the stage aborts the sequence and frees its slot. A call refused before any token
  is tried on another replica (``failover_attempts``); gRPC failures become ``APIError``.
- ``replica_of(request_id)`` names the replica serving a call while it runs; ``failures`` counts, per
  replica, the calls that failed there; ``routed`` counts, per (replica, policy), the calls routed there by
  a client key, by where the prompt's prefix went (``prefix_block_size``: the stages' prefix-cache block
  size; None routes by load alone) or by load (``gateway.mesh.balancer``).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import grpc
import grpc.aio

from gateway.http import errors
from stagemesh_core.grpc_tls import TlsFiles, open_aio_channel
from stagemesh_core.mesh_token import call_metadata
from stagemesh_core.snapshots import MeshView, ReplicaSnapshot
from stagemesh_core.v1 import stage_pb2, stage_pb2_grpc

from .balancer import LeastOutstandingBalancer
from .prefix_routing import PrefixIndex
from .stage_streams import StageStream, StreamedGeneration

_RETRY_ELSEWHERE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)

ReplicaKey = tuple[int, str]  # (replica id, entry target)


class ReplicaClient:
    def __init__(
        self,
        mesh: MeshView,
        *,
        request_timeout_s: float,
        max_outstanding_per_replica: int = 0,
        failover_attempts: int = 1,
        channel_options: Sequence[tuple[str, Any]] = (),
        mesh_token: str = "",
        tls: TlsFiles | None = None,
        prefix_block_size: int | None = None,
    ) -> None:
        self._mesh = mesh
        self._timeout = request_timeout_s
        self._cap = max_outstanding_per_replica
        self._failover = failover_attempts
        self._options = tuple(channel_options)
        self._metadata = call_metadata(mesh_token) if mesh_token else None
        self._tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, stage_pb2_grpc.StageStub] = {}
        self._streams: dict[str, StageStream] = {}  # entry target -> its GenerateStream call
        self.balancer = LeastOutstandingBalancer(
            PrefixIndex(prefix_block_size) if prefix_block_size is not None else None)
        self.routed: dict[tuple[int, str], int] = {}  # (replica, policy: balancer.POLICIES) -> calls routed so far
        self._serving: dict[str, int] = {}  # request id -> the replica its call runs on, while it runs
        self.failures: dict[int, int] = {}  # replica -> requests that failed there

    def replica_of(self, request_id: str) -> int | None:
        """For the dashboard's per-replica latencies."""
        return self._serving.get(request_id)

    @property
    def request_timeout_s(self) -> float:
        return self._timeout

    def _stub(self, target: str) -> stage_pb2_grpc.StageStub:
        stub = self._stubs.get(target)
        if stub is None:
            channel = open_aio_channel(target, self._tls, self._options)
            self._channels[target] = channel
            stub = self._stubs[target] = stage_pb2_grpc.StageStub(channel)
        return stub

    async def close(self) -> None:
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.close()
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()

    def _routable_keys(self) -> list[ReplicaKey]:
        routable: tuple[ReplicaSnapshot, ...] = self._mesh.snapshot().routable_replicas
        return [(r.replica, r.entry.grpc_target) for r in routable]

    def _pick(self, tried: set[ReplicaKey], affinity: str | None, blocks: Sequence[bytes]) -> ReplicaKey:
        keys = self._routable_keys()
        if not keys:
            raise errors.no_healthy_replica()
        index = self.balancer.prefix_index
        if index is not None:
            index.forget_except(keys)  # a replica restarted on a new target starts with an empty cache
        route = self.balancer.route(keys, exclude=tried, cap=self._cap, affinity=affinity, blocks=blocks)
        if route is None:
            raise errors.overloaded(f"every healthy replica has {self._cap} requests in flight")
        counted = (route.key[0], route.policy)
        self.routed[counted] = self.routed.get(counted, 0) + 1
        return route.key

    def _another_replica(self, tried: set[ReplicaKey]) -> bool:
        return bool(self.balancer.eligible(self._routable_keys(), exclude=tried, cap=self._cap))

    async def generate(self, request: stage_pb2.GenerateRequest,
                       affinity: str | None = None) -> AsyncGenerator[stage_pb2.GenerateResponse, None]:
        """The request's responses from one healthy replica (none healthy: one whose stage only missed a check,
        ``MeshSnapshot.routable_replicas``), chosen by ``gateway.mesh.balancer``: the replica an ``affinity``
        hashes to, else the one the prompt's prefix went to (unless it is far busier), else the least loaded. Requests to one entry stage share one ``GenerateStream``
        call: one message per engine step for all of them, the one RPC path to a stage.

        If the call fails UNAVAILABLE or RESOURCE_EXHAUSTED before any token arrived, another healthy replica
        is tried (up to ``failover_attempts`` more); nothing was generated yet, so this cannot duplicate
        output. ``failures`` counts neither calls the client cancelled nor requests refused as invalid.
        """
        tried: set[ReplicaKey] = set()
        attempt = 0
        index = self.balancer.prefix_index
        blocks = index.blocks(request.prompt_token_ids) if index is not None else []
        while True:
            key = self._pick(tried, affinity, blocks)
            tried.add(key)
            self.balancer.acquire(key)
            self._serving[request.request_id] = key[0]
            call: StreamedGeneration | None = None
            received = False
            try:
                call = await self._call(key[1], request)
                async for response in call:
                    received = True
                    yield response
                return
            except grpc.aio.AioRpcError as e:
                # The replica's failures only: not a client that left, nor a request the stage refused as invalid.
                if e.code() not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.INVALID_ARGUMENT):
                    self.failures[key[0]] = self.failures.get(key[0], 0) + 1
                if (not received and e.code() in _RETRY_ELSEWHERE and attempt < self._failover
                        and self._another_replica(tried)):
                    attempt += 1
                    continue
                raise self._api_error(e, received) from None
            finally:
                # Sync on purpose: this also runs while the task is being cancelled.
                if call is not None:
                    call.cancel()
                self.balancer.release(key)
                self._serving.pop(request.request_id, None)

    async def _call(self, target: str, request: stage_pb2.GenerateRequest) -> StreamedGeneration:
        stream = self._streams.get(target)
        if stream is None or stream.closed:
            stream = self._streams[target] = StageStream(self._stub(target), self._metadata)
        return await stream.start(request, self._timeout)

    def _api_error(self, e: grpc.aio.AioRpcError, received: bool) -> errors.APIError:
        """INVALID_ARGUMENT 400, RESOURCE_EXHAUSTED and UNAVAILABLE 503 "overloaded" (after tokens were sent:
        503 pipeline_failed), DEADLINE_EXCEEDED 504, anything else 500."""
        code, details = e.code(), e.details() or e.code().name
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            return errors.bad_request(f"The stage rejected the request: {details}")
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return errors.timed_out(self._timeout)
        if code in _RETRY_ELSEWHERE:
            return errors.pipeline_failed(details) if received else errors.overloaded(details)
        if code == grpc.StatusCode.UNAUTHENTICATED:  # the gateway's token is not the mesh's: an operator's error
            return errors.internal(f"the stage refused the gateway's mesh token ({details})")
        if code == grpc.StatusCode.CANCELLED:
            return errors.pipeline_failed(f"the stage cancelled the request ({details})")
        return errors.internal(f"stage error {code.name}: {details}")
