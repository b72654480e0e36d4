"""One serving stage as an operating-system process: load, connect, then run as entry or relay.

``python -m stage_worker --launch LAUNCH.json`` (see ``stage_worker.__main__``) reads a ``StageLaunch``
(plan, rank, options) and runs ``serve``: ``resolve`` the model's spec, dtype and context length (a bad value
exits ``ExitCode.CONFIG`` before anything loads), start the gRPC server, ``load`` this rank's slice and warm
its kernels, ``connect`` to both neighbours, then ``run_entry`` (rank 0: the scheduler and engine behind
``GenerateStream``) or ``run_relay`` (every other rank, until SHUTDOWN has gone round the ring).

With ``-tp`` a stage is a group of workers (``stage_worker.transport.group``) that join their MLX group before
loading and keep a share each (``StageModel.shard``); worker 0 mirrors each batch to the others (``run_member``).

``run_stage`` is load, connect and run, with the error handling both the server and the test harness
(``stage_worker.service.harness``) share. Exit codes are ``stagemesh_core.states.ExitCode``: 0 done, 2 configuration,
3 a neighbour failed or refused us, 75 a ring operation outlived the ring timeout.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import mlx.core as mx

from stage_worker.cache.prefix_cache import PrefixCache
from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.load_progress import WeightProgress, reporting
from stage_worker.checkpoint.mlx_arch import exact_prefix_reuse, whole_state_reuse
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec
from stage_worker.engine.entry_engine import EntryEngine, PipelineBroken, step_ahead_wanted
from stage_worker.engine.group_member import member_loop
from stage_worker.engine.launcher import KernelLauncher, launcher_wanted, plain_kv_caches
from stage_worker.engine.scheduler import Scheduler
from stage_worker.engine.stage_runtime import EntryPipeline, LogitRecorder, StageCompute, relay_loop
from stage_worker.engine.stage_status import StageStatus
from stage_worker.engine.warmup import warm_up, warmup_plan
from stage_worker.model.blas import AdaptiveBlasThreads, loaded_blas, usable_cores
from stage_worker.model.device import StageDevice, apply_memory_limit, apply_wired_limit, current_backend, probe
from stage_worker.model.expert_routing import policy_for
from stage_worker.model.fused_projections import fusion_wanted
from stage_worker.model.masked_decode_kernel import decode_kernel_wanted
from stage_worker.model.model_facts import draft_facts, model_facts
from stage_worker.model.stage_model import (
    StageModel,
    StageRole,
    choose_dense_weights,
    model_fingerprint,
    resolve_compute_dtype,
)
from stage_worker.parallel.tensor_parallel import kv_part_held
from stage_worker.service.grpc_service import StageDescription, StageServicer, start_grpc_server
from stage_worker.service.memory import (
    MemoryBudgetError,
    host_memory_budget,
    kv_token_capacity,
    peak_rss_bytes,
    stages_sharing_memory,
)
from stage_worker.service.process_setup import SERVING_MLX_CUDA_DEFAULTS
from stage_worker.speculation.draft_proposer import DraftWeights, load_draft_proposer
from stage_worker.speculation.rules import Proposer
from stage_worker.transport import wire
from stage_worker.transport.build_ahead import build_ahead_enabled
from stage_worker.transport.group import GroupIdentity, GroupMirror, accept_leader, group_minimum, join_group
from stage_worker.transport.handshake import StageIdentity, connect_neighbours, init_ring
from stage_worker.transport.links import InboundLink, LinkError, OutboundLink, Ring, RingWatchdog
from stagemesh_core import defaults, settings
from stagemesh_core.gpus import stage_has_own_gpu
from stagemesh_core.grpc_tls import read_tls_dir
from stagemesh_core.plan import StageLaunch
from stagemesh_core.settings import stagemesh_version
from stagemesh_core.speculative import DRAFT_MODEL, SpeculativeConfig
from stagemesh_core.states import ExitCode, StageState

log = logging.getLogger("stagemesh.stage")

_FAILURE_DELIVERY_S = 0.3  # lets gRPC handlers deliver a failure to their callers before exit


@dataclass(frozen=True)
class StageContext:
    """A launch with what it implies resolved: the model's spec, the dtype, the limits."""

    launch: StageLaunch
    spec: ModelSpec
    dtype: mx.Dtype
    max_model_len: int
    ring_timeout_s: float
    device: StageDevice  # the backend and device this stage computes on (stage_worker.model.device)

    @property
    def name(self) -> str:
        return stage_name(self.launch)


def stage_name(launch: StageLaunch) -> str:
    """How this stage names itself in logs and errors."""
    worker = f" worker {launch.member}/{launch.plan.tensor_parallel_size}" if launch.in_group else ""
    return f"replica {launch.plan.replica} stage {launch.rank}/{launch.plan.size}{worker}"


@dataclass(frozen=True)
class LoadedStage:
    model: StageModel
    kv_capacity: int  # tokens of KV this stage holds
    blas_threads: AdaptiveBlasThreads


@dataclass
class StageLinks:
    """This stage's two neighbours (both None in a one-stage pipeline); a group member's ``inbound`` is its
    worker 0's mirror lane, and a group's worker 0 has its ``mirror`` to the members."""

    inbound: InboundLink | None = None
    outbound: OutboundLink | None = None
    mirror: GroupMirror | None = None

    def close(self) -> None:
        for link in (self.inbound, self.outbound, self.mirror):
            if link is not None:
                link.close()


@dataclass(frozen=True)
class RunningStage:
    """What the entry or relay loop runs on once the stage is loaded and connected."""

    context: StageContext
    loaded: LoadedStage
    compute: StageCompute
    links: StageLinks

    def entry_pipeline(self, status: StageStatus, speculating: bool) -> EntryPipeline:
        """The entry stage's pipeline; where ``STAGEMESH_LAUNCH_THREAD`` applies, a kernel launcher evaluates
        its steps (``stage_worker.engine.launcher``)."""
        is_last = self.context.launch.is_last
        # A tensor-parallel stage's members need each batch's input rows before it runs: no launcher thread
        # evaluating later, no graphs built ahead on rows still to come.
        grouped = self.context.launch.in_group
        wanted = not grouped and launcher_wanted(settings.LAUNCH_THREAD, current_backend(), is_last,
                                                 plain_kv_caches(self.compute.model.new_caches()), speculating,
                                                 self.compute.recording)
        launcher = KernelLauncher() if wanted else None
        return EntryPipeline(self.compute, self.links.outbound, self.links.inbound, is_last,
                             reply_timeout_s=self.context.ring_timeout_s, on_batch=status.record_batch,
                             on_wait=status.record_wait,
                             build_ahead=not grouped and build_ahead_enabled(settings.STEP_AHEAD), launcher=launcher)


def resolve(launch: StageLaunch) -> StageContext:
    """The launch's model and limits; raises ``ModelFormatError`` / ``ValueError`` for bad ones."""
    plan = launch.plan
    if plan.model_is_default:
        # Each node finds the embedded default in its own installation.
        spec = read_model_spec(default_model_path(), plan.load_format, plan.first_layers)
    else:
        spec = read_model_spec(plan.model_path, plan.load_format, plan.first_layers)
    # Before any weights load: on CUDA the device's free memory is then the room this stage may fill.
    device = probe()
    dtype = resolve_compute_dtype(plan.compute_dtype, device.backend)
    max_model_len = launch.options.max_model_len or int(spec.args.get("max_position_embeddings")
                                                        or defaults.MAX_MODEL_LEN)
    ring_timeout = launch.options.ring_timeout_s or float(settings.RING_TIMEOUT)
    return StageContext(launch, spec, dtype, max_model_len, ring_timeout, device)


def open_stage(launch: StageLaunch) -> StageContext | None:
    """Log as this stage, then resolve the launch; None (the error logged) when it cannot run."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {stage_name(launch)} %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        return resolve(launch)
    except ValueError as exc:  # ModelFormatError and a bad --dtype included
        log.error("%s", exc)
        return None


def load(ctx: StageContext, status: StageStatus, group: mx.distributed.Group | None = None) -> LoadedStage:
    """Load this rank's slice, choose dense or quantized weights, keep this worker's share of it in a
    tensor-parallel ``group``, size the KV cache within the stage's memory budget (the host's memory on the CPU,
    the GPU's on Metal and CUDA: ``stage_worker.model.device``; a group's is its smallest member's), warm the
    kernels (``stage_worker.engine.warmup``)."""
    launch, me, spec = ctx.launch, ctx.launch.me, ctx.spec
    log.info("loading layers %s of %s (%s) host=%s grpc_port=%d ring_port=%d lane_port=%d",
             me.layers, spec.model_type, launch.plan.model_path, me.host, me.grpc_port, me.ring_port, me.lane_port)
    if spec.random_weights:
        log.info("dummy (random) weights: --load-format dummy, generated for this slice from the model's shapes")
    device, options = ctx.device, launch.options
    wired = apply_wired_limit(device)
    if wired is not None:
        log.info("Metal wired limit %.1f GB (the GPU's recommended working set)", wired / 1e9)
    if device.backend == "cuda":  # set before MLX ran (process_setup.serving_mlx_environment)
        log.info("MLX CUDA settings: %s",
                 " ".join(f"{name}={os.environ.get(name, 'unset')}" for name in SERVING_MLX_CUDA_DEFAULTS))
    sharing = launch.stages_sharing_host()
    own_gpu = stage_has_own_gpu(options.gpu_index, settings.GPU_PER_STAGE)
    budget = host_memory_budget(options.memory_fraction,
                                stages_sharing_memory(device.backend, sharing, options.stages_on_gpu, own_gpu),
                                device.backend, device.memory_bytes, device.free_bytes)
    # Before the load: reading and joining weights frees buffers too, which MLX would otherwise keep.
    limit = apply_memory_limit(device.backend, budget.budget_bytes)
    if limit is not None:
        log.info("MLX memory and cache limit %.1f GB: this stage's budget (--memory-fraction %g of the GPU's %.1f GB "
                 "over %d stage(s))", limit / 1e9, budget.fraction, budget.total_bytes / 1e9, budget.stages_on_host)
    started = time.monotonic()
    # The readers report the bytes they read: a line in the log every few seconds, and GetStageInfo's stats
    # (so `stagemesh status`, /mesh and the dashboard show how far a long load has got).
    progress = WeightProgress(log=log, on_change=lambda counts: setattr(status, "load", counts))
    # A group's worker loads lazily: nothing is read until its share is cut (``shard`` evaluates layer by layer),
    # so it never holds the whole stage's weights, only its share and the layer being cut.
    lazy = group is not None
    share = None
    with reporting(progress):
        # A group member computes layers only: worker 0 embeds, and samples from the group's sum.
        role = StageRole(me.layers, launch.is_first and not launch.is_member, launch.is_last and not launch.is_member)
        model = StageModel.load(spec, role, ctx.dtype, evaluate=not lazy)
        status.blas = loaded_blas()
        # Decided on the whole stage's weights, as every worker of the group decides it alike.
        dense, why = choose_dense_weights(
            launch.plan.dequantize, backend=device.backend, blas=status.blas,
            quantized=model.quantized, dense_bytes=model.dense_bytes(), memory_budget=budget.budget_bytes,
        )
        if dense:
            model.dequantize(evaluate=not lazy)
        log.info("weights %s (%s)", "dequantized" if dense else ("quantized" if model.quantized else "dense"), why)
        if group is not None:
            whole = model.weight_bytes
            # The last stage's worker 0 also reads the whole head for every token: the MLP's split leans away
            # from it.
            head = spec.vocab_size * spec.hidden_size if launch.is_last else 0
            share = model.shard(group, rank_0_extra=head)
    if share is not None:
        log.info("tensor-parallel share: worker %d of %d holds KV heads %d-%d, attention heads %d-%d, intermediate "
                 "features %d-%d: %.1f MB of the slice's %.1f MB, %.1f MB of it read alone from the files (the cut "
                 "tensors' parts)", share.rank, share.size, share.kv_heads.start,
                 share.kv_heads.stop - 1, share.heads.start, share.heads.stop - 1, share.intermediate.start,
                 share.intermediate.stop - 1, model.weight_bytes / 1e6, whole / 1e6, model.parts_read_bytes / 1e6)
    if fusion_wanted(settings.FUSE_PROJECTIONS, device.backend):
        fused = model.fuse_projections()
        log.info("projections joined: q/k/v %s, gate/up %s (%s=off keeps them apart)",
                 "yes" if fused.qkv else "not in every layer", "yes" if fused.gate_up else "not in every layer",
                 settings.env_name("FUSE_PROJECTIONS"))
    if decode_kernel_wanted(settings.DECODE_KERNEL, device.backend):
        model.fused_decode = True
        log.info("decode groups attend through one masked decode kernel (%s=off keeps mlx-lm's masked attention)",
                 settings.env_name("DECODE_KERNEL"))
    experts = policy_for(settings.ALL_EXPERTS_ROWS, device.backend)
    if experts.all_experts_max_rows and (routed := model.route_experts(experts)):
        log.info("expert blocks: every expert on calls of up to %d rows, gathered above (%d blocks; %s=off keeps "
                 "mlx-lm's gathered experts)", experts.all_experts_max_rows, routed,
                 settings.env_name("ALL_EXPERTS_ROWS"))
    status.weight_bytes, status.quantized = model.weight_bytes, model.quantized
    # The planner's count (stage_worker.model.model_facts): each layer's keys and values (MLA's latent), windows
    # bounded by their size, recurrent state per sequence.
    # --kv-cache-dtype: plain KV layers store quantized keys and values, counted as the planner counts them.
    model.kv_cache_dtype = options.kv_cache_dtype
    if options.kv_cache_dtype.quantized:
        log.info("KV cache: %s in every plain KV layer (sliding windows and recurrent state stay in %s)",
                 options.kv_cache_dtype.describe(), wire.dtype_name(ctx.dtype))
    kv = model_facts(spec).with_kv_cache_dtype(options.kv_cache_dtype).slice_kv(me.layers.start, me.layers.end)
    if share is not None:  # a member's caches hold its KV heads only (MLA's latent: whole)
        kv = kv.share(*kv_part_held(spec.model_type, spec.args, share))
    # The entry stage also holds the draft model (--speculative-config "model"), loaded later: its weights and
    # its speculating sequences' KV come out of the room for this stage's KV, as the planner counts them.
    draft = draft_facts(options.speculative, spec, options.max_num_seqs, dense=launch.plan.dequantize == "on") \
        if launch.is_first and not launch.is_member else None
    draft_bytes = draft.reserved_bytes(model.dtype.size, ctx.max_model_len) if draft else 0
    if draft_bytes:
        log.info("the draft model's share of the budget: %.1f MB (weights, and KV for %d speculating sequences)",
                 draft_bytes / 1e6, draft.sequences if draft else 0)
    kv_capacity = kv_token_capacity(budget, model.weight_bytes + draft_bytes, kv, model.dtype.size,
                                    options.max_num_seqs, ctx.max_model_len, ctx.name)
    if group is not None:
        own, kv_capacity = kv_capacity, group_minimum(kv_capacity, group)
        log.info("KV capacity: %d tokens here, %d in the group's smallest member", own, kv_capacity)
    threads = _blas_threads(sharing)
    log.info("loaded %.1f MB of weights in %.2f s (backend=%s device=%r dtype=%s quantized=%s blas=%s, KV "
             "capacity %d tokens in a %.0f MB %s budget, peak RSS %.0f MB)", model.weight_bytes / 1e6,
             time.monotonic() - started, device.backend, device.name, wire.dtype_name(ctx.dtype), model.quantized,
             status.blas, kv_capacity, budget.budget_bytes / 1e6, budget.memory, peak_rss_bytes() / 1e6)
    # Before SERVING: the first requests must not pay for compiling the GPU kernels.
    warmup = warmup_plan(device.backend, max_num_seqs=options.max_num_seqs,
                         micro_batches=options.micro_batches or launch.plan.size,
                         max_batch_tokens=options.max_batch_tokens, max_model_len=ctx.max_model_len)
    warmed = time.monotonic()
    warm_up(model, warmup, in_group=group is not None)
    log.info("warmed up in %.2f s (%s)", time.monotonic() - warmed, warmup.summary())
    return LoadedStage(model, kv_capacity, threads)


def _blas_threads(stages_on_host: int) -> AdaptiveBlasThreads:
    fixed = settings.BLAS_THREADS  # validated by the entry point already
    threads = AdaptiveBlasThreads(usable_cores(), stages_on_host, fixed)
    idle = threads.for_load(0)
    log.info("BLAS threads: %s", f"{idle} to {threads.cores} as the pipeline's load varies" if threads.adaptive
             else f"fixed at {fixed}" if fixed else "not adjustable")
    return threads


def group_identity(ctx: StageContext) -> GroupIdentity:
    launch, me = ctx.launch, ctx.launch.me
    return GroupIdentity(replica=launch.plan.replica, rank=launch.rank, member=launch.member,
                         size=launch.plan.tensor_parallel_size, layers=(me.layers.start, me.layers.end),
                         fingerprint=model_fingerprint(ctx.spec), hidden_size=ctx.spec.hidden_size,
                         wire_dtype=wire.dtype_name(ctx.dtype), backend=launch.plan.tp_backend)


def connect(ctx: StageContext, loaded: LoadedStage, on_member_lost: Callable[[str], None] | None = None,
            ) -> StageLinks:
    """A group member: its worker 0's mirror lane, nothing else. Otherwise the mirror lanes to this stage's
    members (a tensor-parallel worker 0: first, since they wait for nothing else), then the lanes and handshake
    with both neighbours (``stage_worker.transport.handshake``), then (``hop_transport`` "ring") join MLX's
    ring; nothing to do alone (a single-stage pipeline has no links)."""
    launch = ctx.launch
    plan, me = launch.plan, launch.me
    watchdog = RingWatchdog(ctx.ring_timeout_s, ctx.name)
    if launch.is_member:
        inbound = accept_leader(me.host, me.lane_port, group_identity(ctx), launch.options.connect_timeout_s)
        log.info("following stage %d's worker 0 (group of %d)", launch.rank, plan.tensor_parallel_size)
        return StageLinks(inbound=inbound)
    mirror = None
    if launch.in_group:
        mirror = GroupMirror.connect(plan, launch.rank, group_identity(ctx), launch.options.connect_timeout_s,
                                     watchdog)
        if on_member_lost is not None:
            mirror.watch(on_member_lost)
        log.info("tensor-parallel group formed: %d workers over %s", plan.tensor_parallel_size, plan.tp_backend)
    if plan.size == 1:
        return StageLinks(mirror=mirror)
    identity = StageIdentity(
        rank=me.rank, world=plan.size, replica=plan.replica, layers=(me.layers.start, me.layers.end),
        num_layers=plan.num_layers, hidden_size=ctx.spec.hidden_size, wire_dtype=wire.dtype_name(ctx.dtype),
        fingerprint=model_fingerprint(ctx.spec), hop_transport=plan.hop_transport,
    )
    try:
        inbound, outbound = connect_neighbours(plan, me, identity, launch.options.connect_timeout_s)
    except BaseException:
        if mirror is not None:
            mirror.close()
        raise
    links = StageLinks(inbound, outbound, mirror)
    if plan.hop_transport == "lane":
        inbound.attach_lane_payloads()
        outbound.attach_lane_payloads(watchdog)
    else:
        try:
            ring = Ring(init_ring(plan, me.rank, watchdog), watchdog)
        except BaseException:
            links.close()
            raise
        inbound.attach_ring(ring)
        outbound.attach_ring(ring)
    log.info("pipeline formed: %d stages, hidden states over the %s (peak RSS %.0f MB)", plan.size,
             plan.hop_transport, peak_rss_bytes() / 1e6)
    return links


def run_stage(ctx: StageContext, status: StageStatus, body: Callable[[RunningStage], None],
              recorder: LogitRecorder | None = None) -> ExitCode:
    """Join the tensor-parallel group (-tp above 1), load, connect, run ``body`` (the entry's, relay's or
    member's loop), close; the exit code says how it ended."""
    launch = ctx.launch
    group = None
    if launch.in_group:
        try:
            group = join_group(launch.plan, launch.rank, launch.member, RingWatchdog(ctx.ring_timeout_s, ctx.name))
        except LinkError as exc:
            status.set_state(StageState.FAILED, str(exc))
            log.error("%s", exc)
            return ExitCode.PEER
        log.info("joined stage %d's tensor-parallel group as worker %d of %d (%s)", launch.rank, launch.member,
                 launch.plan.tensor_parallel_size, launch.plan.tp_backend)
    try:
        loaded = load(ctx, status, group)
    except (ModelFormatError, MemoryBudgetError, ValueError) as exc:
        status.set_state(StageState.FAILED, str(exc))
        log.error("%s", exc)
        return ExitCode.CONFIG
    compute = StageCompute(loaded.model, ctx.launch.options.max_num_seqs, recorder, loaded.blas_threads)
    status.watch_kv(compute.kv, loaded.kv_capacity)
    status.prefix_cache = compute.kv.prefix_counts
    status.prefix_block_size = ctx.launch.options.prefix_cache_block_size
    status.set_state(StageState.CONNECTING)
    links = StageLinks()
    try:
        links = connect(ctx, loaded, lambda member: _member_lost(status, member))
        compute.mirror = links.mirror
        body(RunningStage(ctx, loaded, compute, links))
        if links.mirror is not None:
            links.mirror.shutdown()
    except (LinkError, wire.WireMismatchError, PipelineBroken) as exc:
        status.set_state(StageState.FAILED, str(exc))
        log.error("%s", exc)
        time.sleep(_FAILURE_DELIVERY_S)
        return ExitCode.PEER
    finally:
        links.close()
    status.set_state(StageState.STOPPED)
    log.info("stopped")
    return ExitCode.OK


def run_entry(stage: RunningStage, status: StageStatus, servicer: StageServicer) -> None:
    """Rank 0: admit requests (the scheduler), drive the pipeline (the engine) until stopped."""
    ctx, options = stage.context, stage.context.launch.options
    speculative = speculation_for(ctx)
    pipeline = stage.entry_pipeline(status, speculating=speculative is not None)
    capacity = pipeline.pipeline_kv_capacity(stage.loaded.kv_capacity)
    scheduler = Scheduler(max_num_seqs=options.max_num_seqs, max_model_len=ctx.max_model_len,
                          max_waiting=options.max_waiting, max_batch_tokens=options.max_batch_tokens,
                          prefill_chunk_tokens=options.max_batch_tokens, kv_token_capacity=capacity,
                          prefix_cache=prefix_cache_for(ctx), speculative=speculative,
                          proposer=proposer_for(speculative, ctx))
    # As many micro-batches in flight as there are stages keeps every stage busy.
    engine = EntryEngine(pipeline, scheduler, status, micro_batches=options.micro_batches or ctx.launch.plan.size,
                         step_ahead=step_ahead_wanted(settings.STEP_AHEAD, ctx.device.backend),
                         on_delivered=servicer.on_delivered)
    servicer.engine = engine
    status.spec_decode = lambda: scheduler.spec_decode.counts
    on_stop_signal(engine.stop)
    status.set_state(StageState.SERVING)
    log.info("serving (max_num_seqs=%d max_model_len=%d, pipeline KV capacity %d tokens, %d micro-batches, "
             "steps ahead: %s, graphs built ahead: %s, launch thread: %s)", options.max_num_seqs, ctx.max_model_len,
             capacity, engine.micro_batches, engine.steps_ahead, pipeline.builds_ahead, pipeline.launches_apart)
    engine.run()


def speculation_for(ctx: StageContext) -> SpeculativeConfig | None:
    """The entry stage's --speculative-config, or None where this model cannot speculate: every stage drops a
    verification's rejected positions from its KV, which a sliding window or a recurrent state cannot do."""
    config = ctx.launch.options.speculative
    if config is None:
        return None
    if not exact_prefix_reuse(ctx.spec):
        log.warning("speculative decoding off: %s layers keep sliding windows or recurrent state, which cannot drop "
                    "rejected proposals (docs/architecture.md)", ctx.spec.model_type)
        return None
    # Unset, the limit is this backend's (an NVIDIA GPU speculates for a lone sequence only).
    config = replace(config, disable_by_batch_size=config.limit_for(ctx.device.backend))
    proposes = f"draft model {config.model}" if config.model else \
        f"prompt lookup of {config.prompt_lookup_min}..{config.prompt_lookup_max} tokens"
    log.info("speculative decoding: up to %d proposals per step (%s), while at most %d sequences run",
             config.num_speculative_tokens, proposes, config.disable_by_batch_size)
    return config


def proposer_for(config: SpeculativeConfig | None, ctx: StageContext) -> Proposer | None:
    """The draft model's proposer, loaded here on the model's thread (MLX streams are per thread), its weights
    dense where this stage's are; None for prompt lookup, which the scheduler makes itself."""
    if config is None or config.method != DRAFT_MODEL or config.model is None:
        return None
    budget = host_memory_budget(ctx.launch.options.memory_fraction, 1, ctx.device.backend, ctx.device.memory_bytes,
                                ctx.device.free_bytes).budget_bytes
    return load_draft_proposer(config.model, DraftWeights(ctx.launch.plan.dequantize, ctx.device.backend,
                                                          loaded_blas(), budget, ctx.dtype))


def prefix_cache_for(ctx: StageContext) -> PrefixCache | None:
    """The entry stage's prefix-cache bookkeeping (None with --no-enable-prefix-caching). Its hashes are salted
    with what else the KV depends on: the model and the compute dtype."""
    options = ctx.launch.options
    if not options.enable_prefix_caching:
        return None
    cut = exact_prefix_reuse(ctx.spec)
    if not cut and not whole_state_reuse(ctx.spec):
        log.info("prefix caching off: %s layers keep state that can be neither cut at a position nor copied "
                 "whole (docs/architecture.md)", ctx.spec.model_type)
        return None
    if not cut:
        log.info("prefix cache: %s layers keep sliding windows or recurrent state, so an entry is a finished "
                 "sequence's whole state, reused by prompts that start with all of it", ctx.spec.model_type)
    kv_dtype = options.kv_cache_dtype
    kv_form = f"/{kv_dtype.name}g{kv_dtype.group_size}" if kv_dtype.quantized else ""
    salt = f"{model_fingerprint(ctx.spec)}/{wire.dtype_name(ctx.dtype)}{kv_form}".encode()
    return PrefixCache(options.prefix_cache_block_size, salt, exact=not cut)


def _member_lost(status: StageStatus, member: str) -> None:
    """A group member died: the group's next all-reduce would never finish, so this worker 0 fails now (health
    says so at once) and exits, and the coordinator brings the whole group back with its replica."""
    message = f"tensor-parallel {member} is gone (its mirror lane closed)"
    status.set_state(StageState.FAILED, message)
    log.error("%s; exiting", message)
    time.sleep(_FAILURE_DELIVERY_S)
    os._exit(ExitCode.PEER)


def run_member(stage: RunningStage, status: StageStatus) -> None:
    """A tensor-parallel group's worker 1..: compute each batch worker 0 mirrors, until SHUTDOWN or a signal."""
    inbound = stage.links.inbound
    assert inbound is not None, "a group member always has its worker 0's lane"
    status.set_state(StageState.SERVING)
    on_stop_signal(_raise_stop)
    try:
        member_loop(stage.compute, inbound, on_batch=status.record_batch)
    except _StopRequested:
        log.info("stop requested")


class _StopRequested(Exception):
    """SIGTERM/SIGINT on a relay stage: leave the relay loop and exit cleanly."""


def _raise_stop() -> None:
    raise _StopRequested()


def run_relay(stage: RunningStage, status: StageStatus) -> None:
    """Every rank but 0: compute each batch that arrives and pass it on, until SHUTDOWN or a signal."""
    inbound, outbound = stage.links.inbound, stage.links.outbound
    assert inbound is not None and outbound is not None, "a relay stage always has two neighbours"
    status.set_state(StageState.SERVING)
    on_stop_signal(_raise_stop)
    try:
        relay_loop(stage.compute, inbound, outbound, stage.context.launch.is_last, on_batch=status.record_batch,
                   kv_token_capacity=stage.loaded.kv_capacity,
                   build_ahead=not stage.context.launch.in_group and build_ahead_enabled(settings.STEP_AHEAD))
    except _StopRequested:
        log.info("stop requested")


def on_stop_signal(action: Callable[[], None]) -> None:
    def handler(signum: int, frame: object) -> None:
        log.info("received %s", signal.Signals(signum).name)
        action()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def describe(ctx: StageContext) -> StageDescription:
    launch, me = ctx.launch, ctx.launch.me
    return StageDescription(
        replica=launch.plan.replica, rank=me.rank, world_size=launch.plan.size,
        layers=(me.layers.start, me.layers.end), num_layers=launch.plan.num_layers, host=me.host,
        grpc_port=me.grpc_port, ring_port=me.ring_port, lane_port=me.lane_port, node_id=launch.options.node_id,
        model=launch.plan.model_path, compute_dtype=wire.dtype_name(ctx.dtype),
        max_num_seqs=launch.options.max_num_seqs, max_model_len=ctx.max_model_len, version=stagemesh_version(),
        backend=ctx.device.backend, device=ctx.device.name,
    )


def serve(launch: StageLaunch) -> int:
    """The serving stage: gRPC first (Stage, health, reflection), so health and ``GetStageInfo`` show progress
    from the first second, then load, connect and run as entry or relay."""
    token = launch.mesh_token or (settings.read("MESH_TOKEN") or "").strip()
    if not token:
        log.error("no mesh token: the launch file has none and %s is unset; the stage will not serve an "
                  "unguarded gRPC port", settings.env_name("MESH_TOKEN"))
        return ExitCode.CONFIG
    tls_dir = settings.GRPC_TLS_DIR or launch.grpc_tls_dir
    try:
        tls = read_tls_dir(tls_dir, "the stage's TLS directory") if tls_dir else None
    except ValueError as exc:
        log.error("%s", exc)
        return ExitCode.CONFIG
    ctx = open_stage(launch)
    if ctx is None:
        return ExitCode.CONFIG
    status = StageStatus()
    try:
        server, servicer = start_grpc_server(describe(ctx), status, mesh_token=token, tls=tls)
    except OSError as exc:
        log.error("%s", exc)
        return ExitCode.CONFIG
    log.info("gRPC control on %s:%d (pid %d, %s)", launch.me.host, launch.me.grpc_port, os.getpid(),
             "mutual TLS" if tls else "plaintext")

    def body(stage: RunningStage) -> None:
        if launch.is_member:
            run_member(stage, status)
        elif launch.is_first:
            run_entry(stage, status, servicer)
        else:
            run_relay(stage, status)

    try:
        return run_stage(ctx, status, body)
    finally:
        server.stop(grace=1.0)
