"""Pipeline plans: frozen descriptions of who runs which slice where.

A ``PipelinePlan`` is everything a stage process needs to know about its
replica: the model, the compute dtype every stage agrees on, and for each rank
its layer range, host and ports. Plans are made by pure functions
(``make_local_plan`` here; Ray placement later), serialised to JSON for the
stage processes, and never mutated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from coordinator.layer_split import LayerRange, plan_layer_split
from coordinator.ports import stage_ports

LOOPBACK = "127.0.0.1"
DEFAULT_RING_BASE_PORT = 32323
DEFAULT_GRPC_BASE_PORT = 50051


@dataclass(frozen=True)
class StagePlacement:
    rank: int  # rank inside the pipeline's ring
    global_index: int  # stage index across all replicas; fixes the ports
    layers: LayerRange
    host: str
    ring_port: int
    lane_port: int
    grpc_port: int

    @property
    def name(self) -> str:
        return f"stage {self.rank} ({self.host})"


@dataclass(frozen=True)
class PipelinePlan:
    replica: int
    model_path: str
    num_layers: int
    compute_dtype: str
    stages: tuple[StagePlacement, ...]
    dequantize: str = "auto"  # auto / on / off: run quantized checkpoints with dense weights
    # The embedded default model: each stage finds it in its own installation, because the
    # head's absolute path need not exist on the other Macs.
    model_is_default: bool = False

    def local_model_path(self) -> str:
        if self.model_is_default:
            from stage_worker.default_model import default_model_path

            return default_model_path()
        return self.model_path

    @property
    def size(self) -> int:
        return len(self.stages)

    def ring_hostfile(self) -> list[list[str]]:
        """MLX_HOSTFILE content: one ``["ip:port"]`` list per rank."""
        return [[f"{s.host}:{s.ring_port}"] for s in self.stages]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        raw = json.loads(text)
        stages = tuple(
            StagePlacement(**{**s, "layers": LayerRange(**s["layers"])})
            for s in raw.pop("stages")
        )
        return cls(**raw, stages=stages)


def make_local_plan(
    model_path: str,
    num_layers: int,
    pipeline_size: int,
    compute_dtype: str,
    *,
    layer_split: str | None = None,
    ring_base_port: int = DEFAULT_RING_BASE_PORT,
    grpc_base_port: int = DEFAULT_GRPC_BASE_PORT,
    host: str = LOOPBACK,
    replica: int = 0,
    first_global_index: int = 0,
    total_stages: int | None = None,
    dequantize: str = "auto",
) -> PipelinePlan:
    """Plan one pipeline with every stage on ``host`` (loopback by default)."""
    ranges = plan_layer_split(num_layers, pipeline_size, layer_split)
    total = total_stages if total_stages is not None else first_global_index + pipeline_size
    stages = []
    for rank, layers in enumerate(ranges):
        g = first_global_index + rank
        ports = stage_ports(g, total, ring_base_port, grpc_base_port)
        stages.append(
            StagePlacement(
                rank=rank,
                global_index=g,
                layers=layers,
                host=host,
                ring_port=ports.ring,
                lane_port=ports.lane,
                grpc_port=ports.grpc,
            )
        )
    return PipelinePlan(
        replica=replica,
        model_path=model_path,
        num_layers=num_layers,
        compute_dtype=compute_dtype,
        stages=tuple(stages),
        dequantize=dequantize,
    )
