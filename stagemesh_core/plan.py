"""Pipeline plans and stage launches: frozen descriptions of who runs which slice where, and how.

A ``PipelinePlan`` is everything a stage process needs to know about its replica: the model, the compute dtype
every stage agrees on, and for each rank its layer range, host and ports. With tensor parallelism
(``tensor_parallel_size`` T > 1) each stage is a group of T worker processes: ``stages`` holds each group's
worker 0 (the one its neighbouring stages talk to), ``members`` the others, ``workers`` all of them in the
coordinator's order (each stage's worker 0, then its members). Plans are made by pure functions
(``make_local_plan`` here; ``coordinator.placement.pipeline_plan`` for Ray), and never mutated.

A ``StageLaunch`` is one stage process's whole input: the plan, its rank (and member) and its ``StageOptions``
(queue sizes, memory share, its GPU, timeouts). The coordinator (or the local launcher) writes it as JSON; the
stage reads it with ``StageLaunch.from_json``. One value, not a hand-built argv that two modules must keep in
step.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from stagemesh_core import defaults
from stagemesh_core.errors import UserError
from stagemesh_core.kv_cache_dtype import AUTO, KVCacheDtype
from stagemesh_core.layer_split import LayerRange, plan_layer_split
from stagemesh_core.ports import member_ports, stage_ports
from stagemesh_core.settings import DEFAULT_GRPC_BASE_PORT, DEFAULT_RING_BASE_PORT, LOOPBACK
from stagemesh_core.speculative import SpeculativeConfig

TP_BACKENDS = ("ring", "jaccl", "nccl")  # MLX's distributed backends a tensor-parallel group can compute over


@dataclass(frozen=True)
class StagePlacement:
    rank: int  # rank inside the pipeline's ring
    global_index: int  # stage index across all replicas; fixes the ports
    layers: LayerRange
    host: str
    ring_port: int  # worker 0: the pipeline ring's port; a member: 0 (it is on no pipeline ring)
    lane_port: int  # worker 0: where its predecessor's control lane arrives; a member: worker 0's mirror lane
    grpc_port: int
    member: int = 0  # its place in the stage's tensor-parallel group (0: the stage's worker 0)
    group_port: int = 0  # its port in the group's MLX group (0: no group, -tp 1)

    @property
    def name(self) -> str:
        return f"stage {self.rank} ({self.host})" if not self.group_port else \
            f"stage {self.rank} worker {self.member} ({self.host})"

    @property
    def ports(self) -> list[int]:
        """Every port this worker binds."""
        return [p for p in (self.ring_port, self.lane_port, self.grpc_port, self.group_port) if p]


@dataclass(frozen=True)
class PipelinePlan:
    replica: int
    model_path: str
    num_layers: int
    compute_dtype: str
    stages: tuple[StagePlacement, ...]
    dequantize: str = "auto"  # auto / on / off: run quantized checkpoints with dense weights
    # The embedded default model: each stage finds it in its own installation, because the
    # head's absolute path need not exist on the other Macs (``model_path`` is only the head's).
    model_is_default: bool = False
    # auto: read the weights from model_path; dummy: each stage makes random ones for its slice
    # (model_path then needs only the config), to benchmark a model's size without its weights.
    load_format: str = "auto"
    # --shape-layers (with load_format dummy): the model is its config's first N decoder layers, its layer
    # pattern kept (stage_worker.checkpoint.first_layers); None: all of them.
    first_layers: int | None = None
    # How hidden states travel between stages: "lane" (their bytes after the header on the stage's
    # TCP lane) or "ring" (MLX's ring). Every stage of a pipeline must use the same.
    hop_transport: str = "lane"
    tensor_parallel_size: int = 1  # workers per stage (-tp)
    tp_backend: str = "ring"  # the MLX backend each group's all-reduces use (TP_BACKENDS)
    members: tuple[StagePlacement, ...] = ()  # the groups' workers 1.. (``stages`` holds each worker 0)

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise UserError(f"--tensor-parallel-size must be at least 1, got {self.tensor_parallel_size}")
        if self.tp_backend not in TP_BACKENDS:
            raise UserError(f"--tp-backend {self.tp_backend!r}: choose one of {', '.join(TP_BACKENDS)}")
        if self.tensor_parallel_size > 1 and self.hop_transport == "ring":
            raise UserError("--hop-transport ring cannot carry a tensor-parallel pipeline's hops: a process joins "
                            "one MLX group, and a -tp stage's is its group's; use --hop-transport lane (the "
                            "default) with -tp")
        if len(self.members) != len(self.stages) * (self.tensor_parallel_size - 1):
            raise ValueError(f"{len(self.members)} group members for {len(self.stages)} stages of "
                             f"{self.tensor_parallel_size} workers")

    @property
    def size(self) -> int:
        return len(self.stages)

    @property
    def workers(self) -> tuple[StagePlacement, ...]:
        """Every worker process of the replica: each stage's worker 0, then that stage's members."""
        return tuple(w for rank in range(self.size) for w in self.group(rank))

    def group(self, rank: int) -> tuple[StagePlacement, ...]:
        """Stage ``rank``'s workers, member 0 first."""
        return (self.stages[rank], *sorted((m for m in self.members if m.rank == rank), key=lambda m: m.member))

    def worker(self, rank: int, member: int) -> StagePlacement:
        group = self.group(rank)
        if not 0 <= member < len(group):
            raise UserError(f"member {member} outside stage {rank}'s group of {len(group)}")
        return group[member]

    def ring_hostfile(self) -> list[list[str]]:
        """MLX_HOSTFILE content: one ``["ip:port"]`` list per rank."""
        return [[f"{s.host}:{s.ring_port}"] for s in self.stages]

    def group_hostfile(self, rank: int) -> list[list[str]]:
        """MLX_HOSTFILE content of stage ``rank``'s tensor-parallel group: one ``["ip:port"]`` per member."""
        return [[f"{w.host}:{w.group_port}"] for w in self.group(rank)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> PipelinePlan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> PipelinePlan:
        raw = dict(raw)
        def placement(s: dict[str, Any]) -> StagePlacement:
            return StagePlacement(**{**s, "layers": LayerRange(**s["layers"])})

        stages = tuple(placement(s) for s in raw.pop("stages"))
        members = tuple(placement(s) for s in raw.pop("members", ()))
        return cls(**raw, stages=stages, members=members)


def with_groups(stages: tuple[StagePlacement, ...], member_hosts: dict[tuple[int, int], str], total_stages: int,
                tensor_parallel_size: int, ring_base_port: int, grpc_base_port: int,
                ) -> tuple[tuple[StagePlacement, ...], tuple[StagePlacement, ...]]:
    """``stages`` as tensor-parallel groups of ``tensor_parallel_size`` (pure): each worker 0 with its group
    port, and every other member (on ``member_hosts[(rank, member)]``) with its ports
    (``stagemesh_core.ports.member_ports``). Unchanged, and no members, at -tp 1."""
    t = tensor_parallel_size
    if t == 1:
        return stages, ()
    leaders, members = [], []
    for s in stages:
        for m in range(t):
            ports = member_ports(s.global_index, m, total_stages, t, ring_base_port, grpc_base_port)
            if m == 0:
                leaders.append(replace(s, group_port=ports.group))
            else:
                members.append(StagePlacement(rank=s.rank, global_index=s.global_index, layers=s.layers,
                                              host=member_hosts[(s.rank, m)], ring_port=0, lane_port=ports.lane,
                                              grpc_port=ports.grpc, member=m, group_port=ports.group))
    return tuple(leaders), tuple(members)


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
    load_format: str = "auto",
    hop_transport: str = "lane",
    tensor_parallel_size: int = 1,
    tp_backend: str = "ring",
) -> PipelinePlan:
    """Plan one pipeline with every stage (and every tensor-parallel worker) on ``host`` (loopback by default)."""
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
    hosts = {(rank, m): host for rank in range(pipeline_size) for m in range(1, tensor_parallel_size)}
    leaders, members = with_groups(tuple(stages), hosts, total, tensor_parallel_size, ring_base_port,
                                   grpc_base_port)
    return PipelinePlan(
        replica=replica,
        model_path=model_path,
        num_layers=num_layers,
        compute_dtype=compute_dtype,
        stages=leaders,
        dequantize=dequantize,
        load_format=load_format,
        hop_transport=hop_transport,
        tensor_parallel_size=tensor_parallel_size,
        tp_backend=tp_backend,
        members=members,
    )


@dataclass(frozen=True)
class StageOptions:
    """How one stage runs, beyond what the plan says; the defaults are a lone stage's."""

    node_id: str = ""  # the Ray node id, reported by GetStageInfo
    max_num_seqs: int = defaults.MAX_NUM_SEQS  # sequences running at once
    max_waiting: int = defaults.MAX_WAITING  # requests queued beyond the running ones
    max_model_len: int | None = None  # None: the model's context length
    memory_fraction: float = defaults.MEMORY_FRACTION  # share of the host's memory its stages may use (weights + KV)
    stages_on_host: int = 0  # stages sharing the host's memory and cores; 0: this pipeline's on it
    micro_batches: int = 0  # batches in flight at once; 0: one per stage
    max_batch_tokens: int = defaults.MAX_BATCH_TOKENS  # token rows per batch (long prompts are prefilled in chunks)
    # Keep finished sequences' KV for prompts that start alike (stage_worker.cache.prefix_cache), in blocks of
    # this many tokens (vLLM's --enable-prefix-caching and --block-size).
    enable_prefix_caching: bool = defaults.ENABLE_PREFIX_CACHING
    prefix_cache_block_size: int = defaults.PREFIX_CACHE_BLOCK_SIZE
    # --kv-cache-dtype: keys and values of plain KV layers stored quantized (stagemesh_core.kv_cache_dtype).
    kv_cache_dtype: KVCacheDtype = AUTO
    connect_timeout_s: float = defaults.CONNECT_TIMEOUT_S  # neighbours' lanes must be up by then
    ring_timeout_s: float | None = None  # None: STAGEMESH_RING_TIMEOUT where the stage runs
    # The node's visible GPU this stage computes on (stagemesh_core.gpus); None: the node's default.
    gpu_index: int | None = None
    stages_on_gpu: int = 0  # stages sharing that GPU's memory; 0: unknown (the host's count applies)
    # --speculative-config (stagemesh_core.speculative): the entry stage proposes, the last verifies; None: off.
    speculative: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_batch_tokens", "prefix_cache_block_size"):
            if getattr(self, name) < 1:
                raise UserError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.gpu_index is not None and self.gpu_index < 0:
            raise UserError(f"gpu_index must not be negative, got {self.gpu_index}")
        for name in ("max_waiting", "stages_on_host", "micro_batches", "stages_on_gpu"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must not be negative, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise UserError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if not 0 < self.memory_fraction <= 1:
            raise UserError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        for name in ("connect_timeout_s", "ring_timeout_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise UserError(f"{name} must be positive, got {value}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StageOptions:
        """The options as ``asdict`` wrote them (the launch file)."""
        speculative = raw.get("speculative")
        kv_dtype = raw.get("kv_cache_dtype")
        return cls(**{**raw, "speculative": None if speculative is None else SpeculativeConfig.from_json(speculative),
                      "kv_cache_dtype": AUTO if kv_dtype is None else KVCacheDtype.from_dict(kv_dtype)})


@dataclass(frozen=True)
class StageLaunch:
    """Everything one stage process is started with."""

    plan: PipelinePlan
    rank: int
    options: StageOptions = field(default_factory=StageOptions)
    # The secret its gRPC port requires on state-changing calls (stagemesh_core.mesh_token). It travels
    # in the launch file (written 0600 in a 0700 directory), never on a command line; "" here means the
    # stage takes STAGEMESH_MESH_TOKEN from its node's environment. repr=False: never in a log line.
    mesh_token: str = field(default="", repr=False)
    # Mutual TLS for the stage's gRPC port: its node's TLS directory (stagemesh_core.grpc_tls); the node's
    # own STAGEMESH_GRPC_TLS_DIR wins, since the head's path need not exist there. "": plaintext.
    grpc_tls_dir: str = ""
    member: int = 0  # its place in the stage's tensor-parallel group (0: the stage's worker 0)

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.plan.size:
            raise UserError(f"rank {self.rank} outside the plan's 0..{self.plan.size - 1}")
        if not 0 <= self.member < self.plan.tensor_parallel_size:
            raise UserError(f"member {self.member} outside a group of {self.plan.tensor_parallel_size}")
        if self.plan.hop_transport not in ("lane", "ring"):
            raise UserError(f"hop transport {self.plan.hop_transport!r}: choose lane or ring")

    @property
    def me(self) -> StagePlacement:
        return self.plan.worker(self.rank, self.member)

    @property
    def in_group(self) -> bool:
        """This stage computes as a tensor-parallel group (-tp above 1)."""
        return self.plan.tensor_parallel_size > 1

    @property
    def is_member(self) -> bool:
        """A group's worker 1..: it follows its worker 0's batches and talks to no other stage."""
        return self.member > 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.plan.size - 1

    def stages_sharing_host(self) -> int:
        """Stages sharing this stage's host: the coordinator's count per node, else this plan's."""
        return self.options.stages_on_host or sum(1 for s in self.plan.workers if s.host == self.me.host)

    def to_json(self) -> str:
        return json.dumps({"plan": asdict(self.plan), "rank": self.rank, "member": self.member,
                           "options": asdict(self.options), "mesh_token": self.mesh_token,
                           "grpc_tls_dir": self.grpc_tls_dir}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> StageLaunch:
        raw = json.loads(text)
        return cls(PipelinePlan.from_dict(raw["plan"]), int(raw["rank"]), StageOptions.from_dict(raw["options"]),
                   mesh_token=str(raw.get("mesh_token", "")), grpc_tls_dir=str(raw.get("grpc_tls_dir", "")),
                   member=int(raw.get("member", 0)))
