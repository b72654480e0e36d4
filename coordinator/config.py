"""The mesh's configuration: ``MeshConfig``, its checks, and the options each stage is started with.

- ``MeshConfig`` is every setting of one mesh (model, ``-pp`` x ``-dp``,
  ports, stage options the user gave, health and startup timing, the restart
  backoff); frozen, built once by ``stagemesh serve`` (or a test).
- ``validate_config`` fails before Ray is touched when the flags cannot
  describe a mesh.
- ``stage_options`` is a serving stage's ``StageOptions``: what the user left
  unset keeps the stage's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from coordinator.layer_planner import PlanRequest
from coordinator.placement import PlacementError, check_port_ranges
from coordinator.stage_host import DEFAULT_STAGE_COMMAND
from coordinator.supervision import BackoffPolicy
from stagemesh_core import defaults
from stagemesh_core.grpc_tls import TlsFiles
from stagemesh_core.kv_cache_dtype import AUTO, KVCacheDtype
from stagemesh_core.layer_split import plan_layer_split
from stagemesh_core.memory import DraftFacts, ModelFacts
from stagemesh_core.plan import StageOptions
from stagemesh_core.settings import DEFAULT_GRPC_BASE_PORT, DEFAULT_RING_BASE_PORT
from stagemesh_core.speculative import SpeculativeConfig


@dataclass(frozen=True)
class MeshConfig:
    model_path: str
    served_model_name: str
    num_layers: int
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    compute_dtype: str = "auto"
    dequantize: str = "auto"  # --dequantize
    load_format: str = "auto"  # --load-format: dummy gives every stage random weights for its slice
    first_layers: int | None = None  # --shape-layers: a dummy model's first N decoder layers only
    hop_transport: str = "lane"  # --hop-transport: how hidden states travel between stages (lane or ring)
    tensor_parallel_size: int = 1  # -tp: worker processes per stage, each holding 1/T of its sharded weights
    tp_backend: str = "ring"  # --tp-backend: the MLX backend of each group's all-reduces
    memory_fraction: float | None = None  # --memory-fraction (None: the stage's default)
    model_is_default: bool = False  # no MODEL given: every node uses its own embedded default
    layer_split: str | None = None  # --pp-layer-split
    ring_base_port: int = DEFAULT_RING_BASE_PORT
    grpc_base_port: int = DEFAULT_GRPC_BASE_PORT
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool | None = None  # --enable-prefix-caching / --no-enable-prefix-caching
    prefix_cache_block_size: int | None = None  # --prefix-cache-block-size
    kv_cache_dtype: KVCacheDtype | None = None  # --kv-cache-dtype / --kv-cache-group-size
    speculative: SpeculativeConfig | None = None  # --speculative-config
    ray_address: str | None = None  # None: RAY_ADDRESS, else a local loopback Ray
    startup_timeout_s: float = defaults.STARTUP_TIMEOUT_S
    placement_timeout_s: float = 30.0
    connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S  # passed to each stage (--connect-timeout)
    health_interval_s: float = 1.0
    health_timeout_s: float = 1.0  # deadline of each health RPC
    unhealthy_after_misses: int = 3
    stop_grace_s: float = 5.0
    backoff: BackoffPolicy = BackoffPolicy()  # how long a replica that keeps dying waits between restarts
    stage_command: tuple[str, ...] = DEFAULT_STAGE_COMMAND  # after `python`; `--launch FILE` follows
    # The model's size (stage_worker.model.model_facts): the layer planner splits by each node's memory. None: even
    # split / --pp-layer-split, unchecked (the fake stages of the coordinator's tests have no model). Its KV in
    # the compute dtype: ``planned_facts`` counts it as --kv-cache-dtype stores it, and auto's for comparison.
    model_facts: ModelFacts | None = None
    # The draft model's size (stage_worker.model.model_facts.draft_facts), held beside the entry stage's slice.
    draft_facts: DraftFacts | None = None
    # Every stage's gRPC port requires it on state-changing calls; "" makes the coordinator generate one
    # (``MeshCoordinator.mesh_token``). repr=False: never in a log line.
    mesh_token: str = field(default="", repr=False)
    grpc_tls: TlsFiles | None = None  # mutual TLS to the stages (--grpc-tls-dir); None: plaintext

    @property
    def total_stages(self) -> int:
        return self.pipeline_parallel_size * self.data_parallel_size

    @property
    def total_workers(self) -> int:
        """Stage processes in the mesh: every stage's tensor-parallel workers (one per ``mlx`` unit)."""
        return self.total_stages * self.tensor_parallel_size

    def planned_facts(self, kv_cache_dtype: KVCacheDtype | None = None) -> ModelFacts | None:
        """The model as the layer planner counts one stage's worker (``ModelFacts.worker_share``), its KV stored
        as ``kv_cache_dtype`` says (default: --kv-cache-dtype's), quantized before the share as a worker's
        stage counts it."""
        if self.model_facts is None:
            return None
        kv = kv_cache_dtype or self.kv_cache_dtype or AUTO
        return self.model_facts.with_kv_cache_dtype(kv).worker_share(self.tensor_parallel_size)

    def auto_kv_facts(self) -> ModelFacts | None:
        """With a quantized --kv-cache-dtype, ``planned_facts`` with KV in the compute dtype: what the plan
        states the quantized plan's context against (``layer_planner.auto_kv_tokens``); else None."""
        return self.planned_facts(AUTO) if self.kv_cache_dtype and self.kv_cache_dtype.quantized else None

    def plan_request(self) -> PlanRequest:
        """What the layer planner must fit (the stage's own defaults where the user left a flag unset)."""
        return PlanRequest(
            max_model_len=self.max_model_len or defaults.MAX_MODEL_LEN,
            max_num_seqs=self.max_num_seqs or defaults.MAX_NUM_SEQS,
            memory_fraction=self.memory_fraction or defaults.MEMORY_FRACTION, compute_dtype=self.compute_dtype,
            layer_split=self.layer_split, draft=self.draft_facts, kv_cache_dtype=self.kv_cache_dtype or AUTO)


def validate_config(config: MeshConfig) -> None:
    """Fail before touching Ray when the flags cannot describe a mesh."""
    if min(config.pipeline_parallel_size, config.data_parallel_size, config.tensor_parallel_size) < 1:
        raise PlacementError(
            f"--pipeline-parallel-size/-pp, --data-parallel-size/-dp and --tensor-parallel-size/-tp must be at "
            f"least 1, got {config.pipeline_parallel_size}, {config.data_parallel_size} and "
            f"{config.tensor_parallel_size}."
        )
    plan_layer_split(config.num_layers, config.pipeline_parallel_size, config.layer_split)
    check_port_ranges(config.total_stages, config.ring_base_port, config.grpc_base_port, config.tensor_parallel_size)
    if config.health_interval_s <= 0 or config.unhealthy_after_misses < 1:
        raise ValueError("health_interval_s must be positive and unhealthy_after_misses at least 1")


def stage_options(config: MeshConfig, node_id: str, stages_on_node: int = 1, gpu_index: int | None = None,
                  stages_on_gpu: int = 0) -> StageOptions:
    """A serving stage's options; ``stages_on_node`` stages share its node's memory and cores, and
    ``stages_on_gpu`` the GPU ``gpu_index`` of its node (``placement.assign_gpus``; None: no GPU to
    assign). What the user left unset keeps the stage's default. ``stages_on_node`` is passed even when 1: the
    coordinator knows which stages share a node (two Ray nodes may share an address, as in a simulated
    cluster), and the layer plan sized each stage's budget by that count."""
    given: dict[str, Any] = {"memory_fraction": config.memory_fraction, "max_num_seqs": config.max_num_seqs,
                             "max_model_len": config.max_model_len,
                             "enable_prefix_caching": config.enable_prefix_caching,
                             "prefix_cache_block_size": config.prefix_cache_block_size,
                             "speculative": config.speculative, "kv_cache_dtype": config.kv_cache_dtype}
    return StageOptions(node_id=node_id, connect_timeout_s=config.connect_timeout_s,
                        stages_on_host=stages_on_node, gpu_index=gpu_index,
                        stages_on_gpu=stages_on_gpu if gpu_index is not None else 0,
                        **{name: value for name, value in given.items() if value is not None})
