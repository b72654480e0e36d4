"""One stage as an operating-system process: load the slice, join the pipeline, serve.

``python -m stage_worker.stage_process --plan PLAN.json --rank R`` loads rank R's
slice of the plan's model, opens its control lane, connects to its successor's,
checks with both neighbours that they belong to the same pipeline (handshake),
then joins MLX's ring (``MLX_RANK`` and ``MLX_HOSTFILE`` from the plan,
``mx.distributed.init(backend="ring", strict=True)``). The first rank then runs
the work it was given (``--job``: a generation job) and stops the pipeline; the
others relay until the SHUTDOWN message has gone round the ring.

Exit codes: 0 done; 2 bad configuration; 3 a neighbour failed or refused us;
75 a ring operation outlived ``--ring-timeout`` (frozen peer).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from coordinator.plan import PipelinePlan, StagePlacement
from stage_worker import wire
from stage_worker.blas import AdaptiveBlasThreads, fixed_threads, loaded_blas, usable_cores
from stage_worker.engine import EntryEngine, PipelineBroken
from stage_worker.generation_job import GenerationJob, run_generation
from stage_worker.grpc_service import StageDescription, start_grpc_server
from stage_worker.links import InboundLink, LinkError, OutboundLink, Ring, RingWatchdog
from stage_worker.memory import (
    MemoryBudgetError,
    host_memory_budget,
    kv_bytes_per_token,
    kv_token_capacity,
    peak_rss_bytes,
)
from stage_worker.model_spec import ModelFormatError, read_model_spec
from stage_worker.scheduler import Scheduler
from stage_worker.stage_model import (
    StageModel,
    StageRole,
    choose_dense_weights,
    model_fingerprint,
    resolve_compute_dtype,
)
from stage_worker.stage_runtime import EntryPipeline, LogitRecorder, StageCompute, relay_loop
from stage_worker.stage_status import StageState, StageStatus
from stagemesh import envs
from stagemesh.version import stagemesh_version

log = logging.getLogger("stagemesh.stage")

EXIT_CONFIG = 2
EXIT_PEER = 3


@dataclass(frozen=True)
class StageIdentity:
    """What a stage tells its neighbour in the handshake; both sides must agree."""

    rank: int
    world: int
    replica: int
    layers: tuple[int, int]
    num_layers: int
    hidden_size: int
    wire_dtype: str
    fingerprint: str

    def to_body(self) -> dict:
        return {"protocol": wire.PROTOCOL_VERSION, **self.__dict__, "layers": list(self.layers)}


def check_predecessor(me: StageIdentity, body: dict) -> str | None:
    """Pure handshake rule: why the stage that sent ``body`` cannot feed ``me`` (None if it can)."""
    expected_rank = (me.rank - 1) % me.world
    if body.get("protocol") != wire.PROTOCOL_VERSION:
        return f"wire protocol v{body.get('protocol')} != v{wire.PROTOCOL_VERSION}; run one stagemesh version"
    if body.get("world") != me.world or body.get("replica") != me.replica:
        return (f"peer belongs to a pipeline of {body.get('world')} stages (replica "
                f"{body.get('replica')}), this stage to {me.world} (replica {me.replica})")
    if body.get("rank") != expected_rank:
        return f"peer is rank {body.get('rank')}, expected rank {expected_rank} before rank {me.rank}"
    if body.get("fingerprint") != me.fingerprint:
        return "peer loaded a different model (architecture or shapes differ)"
    if body.get("hidden_size") != me.hidden_size or body.get("wire_dtype") != me.wire_dtype:
        return (f"peer sends hidden size {body.get('hidden_size')} in {body.get('wire_dtype')}, "
                f"this stage takes {me.hidden_size} in {me.wire_dtype}; give every stage the same --dtype")
    peer_end = body.get("layers", [None, None])[1]
    my_start = me.layers[0] if me.rank != 0 else me.num_layers
    if peer_end != my_start:
        return (f"peer's layers end at {peer_end} but this stage starts at {my_start}: "
                f"the layer split has a gap or overlap")
    return None


def connect_neighbours(
    plan: PipelinePlan, me: StagePlacement, identity: StageIdentity, deadline_s: float
) -> tuple[InboundLink, OutboundLink]:
    """Open our lane, connect to the successor's, and handshake both ways concurrently.

    Accepting runs on a thread because every stage both accepts and connects:
    done in sequence, the ring of handshakes would wait on itself.
    """
    prev_rank = (me.rank - 1) % plan.size
    next_stage = plan.stages[(me.rank + 1) % plan.size]
    inbound = InboundLink(None, prev_rank, f"stage {prev_rank} ({plan.stages[prev_rank].host})")
    outbound = OutboundLink(None, next_stage.rank, f"stage {next_stage.rank} ({next_stage.host})")
    inbound.listen(me.host, me.lane_port)
    errors: list[BaseException] = []

    def accept() -> None:
        try:
            inbound.accept(deadline_s, lambda body: check_predecessor(identity, body))
        except BaseException as exc:  # reported by the main thread below
            errors.append(exc)

    acceptor = threading.Thread(target=accept, name="lane-accept", daemon=True)
    acceptor.start()
    outbound.connect(next_stage.host, next_stage.lane_port, deadline_s)
    outbound.handshake(identity.to_body(), deadline_s)
    acceptor.join()
    if errors:
        raise errors[0]
    return inbound, outbound


def init_ring(plan: PipelinePlan, rank: int, watchdog: RingWatchdog) -> mx.distributed.Group:
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix=f"stagemesh-ring-{rank}-", delete=False) as f:
        json.dump(plan.ring_hostfile(), f)
        hostfile = f.name
    os.environ["MLX_RANK"] = str(rank)
    os.environ["MLX_HOSTFILE"] = hostfile
    try:
        with watchdog.guard("ring init"):
            group = mx.distributed.init(backend="ring", strict=True)
    finally:
        os.unlink(hostfile)
    if group.size() != plan.size or group.rank() != rank:
        raise LinkError(
            f"MLX ring formed with size {group.size()} rank {group.rank()}, expected size "
            f"{plan.size} rank {rank}: check MLX_RANK/MLX_HOSTFILE and that every host in the "
            f"hostfile is reachable"
        )
    return group


class _StopRequested(Exception):
    """SIGTERM/SIGINT on a relay stage: leave the relay loop and exit cleanly."""


def _describe(plan: PipelinePlan, me: StagePlacement, args: argparse.Namespace, spec, dtype) -> StageDescription:
    return StageDescription(
        replica=plan.replica, rank=me.rank, world_size=plan.size, layers=(me.layers.start, me.layers.end),
        num_layers=plan.num_layers, host=me.host, grpc_port=me.grpc_port, ring_port=me.ring_port,
        lane_port=me.lane_port, node_id=args.node_id, model=plan.model_path,
        compute_dtype=wire.dtype_name(dtype), max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len or 0, version=stagemesh_version(),
    )


def run(args: argparse.Namespace) -> int:
    plan = PipelinePlan.from_json(open(args.plan).read())
    me = plan.stages[args.rank]
    stage_name = f"replica {plan.replica} stage {me.rank}/{plan.size}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {stage_name} %(levelname)s %(message)s",
                        stream=sys.stderr)
    try:
        spec = read_model_spec(plan.local_model_path())
        dtype = resolve_compute_dtype(plan.compute_dtype)
    except (ModelFormatError, ValueError) as exc:
        log.error("%s", exc)
        return EXIT_CONFIG
    if args.max_model_len is None:
        args.max_model_len = int(spec.args.get("max_position_embeddings") or 4096)
    status = StageStatus()
    server = servicer = None
    if args.serve:
        try:
            server, servicer = start_grpc_server(_describe(plan, me, args, spec, dtype), status,
                                                 max_workers=args.max_num_seqs + args.max_waiting + 16)
        except OSError as exc:
            log.error("%s", exc)
            return EXIT_CONFIG
        log.info("gRPC control on %s:%d", me.host, me.grpc_port)
    try:
        return _serve_stage(args, plan, me, spec, dtype, status, servicer, stage_name)
    finally:
        if server is not None:
            server.stop(grace=1.0).wait()


def _serve_stage(args, plan, me, spec, dtype, status, servicer, stage_name) -> int:
    is_first, is_last = me.rank == 0, me.rank == plan.size - 1
    log.info("loading layers %s of %s (%s) host=%s grpc_port=%d ring_port=%d lane_port=%d",
             me.layers, spec.model_type, plan.model_path, me.host, me.grpc_port, me.ring_port, me.lane_port)
    started = time.monotonic()
    try:
        model = StageModel.load(spec, StageRole(me.layers, is_first, is_last), dtype)
    except ModelFormatError as exc:
        status.set_state(StageState.FAILED, str(exc))
        log.error("%s", exc)
        return EXIT_CONFIG
    try:
        kv_capacity = _prepare_weights_and_kv(args, plan, me, spec, model, status, stage_name)
    except (MemoryBudgetError, ValueError) as exc:
        status.set_state(StageState.FAILED, str(exc))
        log.error("%s", exc)
        return EXIT_CONFIG
    log.info("loaded %.1f MB of weights in %.2f s (dtype=%s quantized=%s blas=%s, KV capacity %d tokens, "
             "peak RSS %.0f MB)", model.weight_bytes / 1e6, time.monotonic() - started, wire.dtype_name(dtype),
             model.quantized, status.blas, kv_capacity, peak_rss_bytes() / 1e6)
    recorder = LogitRecorder() if (args.record_logits and is_last) else None
    compute = StageCompute(model, args.max_num_seqs, recorder, _blas_threads(args, plan, me))
    inbound = outbound = None
    status.set_state(StageState.CONNECTING)
    try:
        if plan.size > 1:
            identity = StageIdentity(
                rank=me.rank, world=plan.size, replica=plan.replica,
                layers=(me.layers.start, me.layers.end), num_layers=plan.num_layers,
                hidden_size=spec.hidden_size, wire_dtype=wire.dtype_name(dtype),
                fingerprint=model_fingerprint(spec),
            )
            inbound, outbound = connect_neighbours(plan, me, identity, args.connect_timeout)
            watchdog = RingWatchdog(args.ring_timeout, stage_name)
            ring = Ring(init_ring(plan, me.rank, watchdog), watchdog)
            inbound.attach_ring(ring)
            outbound.attach_ring(ring)
            log.info("joined the ring of %d stages (peak RSS %.0f MB)", plan.size, peak_rss_bytes() / 1e6)
        if is_first:
            pipeline = EntryPipeline(compute, outbound, inbound, is_last, reply_timeout_s=args.ring_timeout,
                                     on_batch=status.record_batch, on_wait=status.record_wait)
            if args.serve:
                capacity = pipeline.pipeline_kv_capacity(kv_capacity)
                _serve_entry(args, pipeline, status, servicer, plan.size, capacity)
            else:
                if args.job:
                    job = GenerationJob.from_dict(json.load(open(args.job)))
                    _write_json(args.job_result, run_generation(pipeline, job).to_dict())
                pipeline.shutdown()
        else:
            assert inbound is not None and outbound is not None
            status.set_state(StageState.SERVING)
            _on_stop_signal(lambda: _raise_stop())
            try:
                relay_loop(compute, inbound, outbound, is_last, on_batch=status.record_batch,
                           kv_token_capacity=kv_capacity)
            except _StopRequested:
                log.info("stop requested")
    except (LinkError, wire.WireMismatchError, PipelineBroken) as exc:
        status.set_state(StageState.FAILED, str(exc))
        log.error("%s", exc)
        time.sleep(0.3)  # let gRPC handlers deliver the failure to their callers
        return EXIT_PEER
    finally:
        for link in (inbound, outbound):
            if link is not None:
                link.close()
    status.set_state(StageState.STOPPED)
    if recorder is not None:
        recorder.save(args.record_logits)
    if args.stats:
        _write_json(args.stats, {
            "rank": me.rank, "layers": [me.layers.start, me.layers.end],
            "weight_bytes": model.weight_bytes, "peak_rss_bytes": peak_rss_bytes(),
        })
    log.info("stopped")
    return 0


def _prepare_weights_and_kv(args, plan, me, spec, model: StageModel, status: StageStatus, stage_name: str) -> int:
    """Choose dense or quantized weights and size this stage's KV capacity (tokens)."""
    budget = host_memory_budget(args.memory_fraction, _stages_on_host(args, plan, me))
    status.blas = loaded_blas()
    dense, why = choose_dense_weights(
        plan.dequantize, on_gpu=mx.default_device() == mx.gpu, blas=status.blas, quantized=model.quantized,
        dense_bytes=model.dense_bytes(), memory_budget=budget.budget_bytes,
    )
    if dense:
        model.dequantize()
    log.info("weights %s (%s)", "dequantized" if dense else ("quantized" if model.quantized else "dense"), why)
    status.weight_bytes, status.quantized = model.weight_bytes, model.quantized
    args_ = spec.args
    head_dim = int(args_.get("head_dim") or spec.hidden_size // int(args_["num_attention_heads"]))
    kv_heads = int(args_.get("num_key_value_heads") or args_["num_attention_heads"])
    per_token = kv_bytes_per_token(len(me.layers), kv_heads, head_dim, model.dtype.size)
    return kv_token_capacity(budget, model.weight_bytes, per_token, args.max_model_len, stage_name)


def _blas_threads(args, plan: PipelinePlan, me: StagePlacement) -> AdaptiveBlasThreads:
    fixed = fixed_threads(os.environ)  # validated by the entry point already
    threads = AdaptiveBlasThreads(usable_cores(), _stages_on_host(args, plan, me), fixed)
    idle = threads.for_load(0)
    log.info("BLAS threads: %s", f"{idle} to {threads.cores} as the pipeline's load varies" if threads.adaptive
             else f"fixed at {fixed}" if fixed else "not adjustable")
    return threads


def _stages_on_host(args, plan: PipelinePlan, me: StagePlacement) -> int:
    """Stages sharing this stage's host: ``--stages-on-host`` (the coordinator counts per node), else the plan's."""
    return args.stages_on_host or sum(1 for s in plan.stages if s.host == me.host)


def _serve_entry(args, pipeline: EntryPipeline, status: StageStatus, servicer, pipeline_size: int,
                 kv_capacity: int) -> None:
    scheduler = Scheduler(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                          max_waiting=args.max_waiting, max_batch_tokens=args.max_batch_tokens,
                          prefill_chunk_tokens=args.max_batch_tokens, kv_token_capacity=kv_capacity)
    # As many micro-batches in flight as there are stages keeps every stage busy.
    engine = EntryEngine(pipeline, scheduler, status, micro_batches=args.micro_batches or pipeline_size)
    servicer.engine = engine
    _on_stop_signal(engine.stop)
    status.set_state(StageState.SERVING)
    log.info("serving (max_num_seqs=%d max_model_len=%d, pipeline KV capacity %d tokens, %d micro-batches)",
             args.max_num_seqs, args.max_model_len, kv_capacity, engine.micro_batches)
    engine.run()


def _raise_stop() -> None:
    raise _StopRequested()


def _on_stop_signal(action) -> None:
    def handler(signum, frame):
        log.info("received %s", signal.Signals(signum).name)
        action()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _write_json(path: str | None, data: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(data, f)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m stage_worker.stage_process", description=__doc__)
    parser.add_argument("--plan", required=True, help="pipeline plan JSON written by the coordinator")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--serve", action="store_true",
                        help="serve gRPC (Stage, health, reflection) on the plan's grpc_port until SIGTERM")
    parser.add_argument("--node-id", default="", help="Ray node id, reported by GetStageInfo")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences running at once")
    parser.add_argument("--max-waiting", type=int, default=256, help="requests queued beyond the running ones")
    parser.add_argument("--max-model-len", type=int, default=None, help="default: the model's context length")
    parser.add_argument("--memory-fraction", type=float, default=0.8,
                        help="share of the host's memory the stages on it may use (weights + KV cache)")
    parser.add_argument("--stages-on-host", type=int, default=0,
                        help="stages sharing this host's memory (default: this pipeline's stages on it)")
    parser.add_argument("--micro-batches", type=int, default=0,
                        help="batches in flight at once (default: the number of stages)")
    parser.add_argument("--max-batch-tokens", type=int, default=512,
                        help="token rows per batch (long prompts are prefilled in chunks of this size)")
    parser.add_argument("--connect-timeout", type=float, default=60.0)
    parser.add_argument("--ring-timeout", type=float, default=envs.RING_TIMEOUT)
    parser.add_argument("--job", help="generation job JSON (first stage only)")
    parser.add_argument("--job-result", help="where the first stage writes the job's outputs")
    parser.add_argument("--record-logits", help="last stage: save every sampled row's logits (.npz)")
    parser.add_argument("--stats", help="write weight bytes and peak RSS here on exit")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
