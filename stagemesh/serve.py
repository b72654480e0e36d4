"""``stagemesh serve [MODEL]``: place a mesh of pipeline stages with Ray and serve the OpenAI API.

Order of events: every flag is validated before anything starts (model file,
layer split, port ranges, context length, the gateway's port); the coordinator
joins the Ray cluster at ``RAY_ADDRESS`` or starts a local one on loopback with
just enough ``mlx`` units, places ``-pp`` x ``-dp`` x ``-tp`` stage processes, and waits
until every stage serves; then the FastAPI gateway listens on ``--host:--port`` (and ``--ollama-port``).
Ctrl-C or SIGTERM stops the gateway, every stage, and the local Ray it started.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Any

from stage_worker.checkpoint.default_model import resolve_model_path
from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec
from stagemesh import openai_flags, security_flags

# The model shapes shipped with the benchmarks are also the names --load-format dummy knows.
from stagemesh.bench.random_checkpoint import SHAPES_DIR, add_load_format_argument, shape_names
from stagemesh_core import defaults, settings
from stagemesh_core.errors import UserError
from stagemesh_core.kv_cache_dtype import DEFAULT_KV_GROUP_SIZE, KV_CACHE_DTYPES, parse_kv_cache_dtype
from stagemesh_core.layer_split import plan_layer_split
from stagemesh_core.plan import TP_BACKENDS
from stagemesh_core.ports import check_port_base, data_plane_ports, port_is_free
from stagemesh_core.speculative import parse_speculative_config

log = logging.getLogger("stagemesh.serve")



def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default=None,
                        help="GGUF file, MLX/Hugging Face model directory, or cached HF repo id "
                             "(default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address (default %(default)s)")
    parser.add_argument("--port", type=int, default=settings.DEFAULT_GATEWAY_PORT,
                        help="gateway port (default %(default)s)")
    parser.add_argument("--ollama-port", type=int, default=None, metavar="N",
                        help="also listen on this port for Ollama's clients (Ollama's own is 11434): the same gateway, "
                             "where GET / answers 'Ollama is running' as Ollama does (default: off)")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                        help="stages per replica, each holding a contiguous slice of the layers")
    parser.add_argument("--data-parallel-size", "-dp", type=int, default=1, help="replicas of the pipeline")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="workers per stage, each its own process on its own mlx unit (its own Mac or GPU) "
                             "holding 1/N of the stage's attention heads and MLP; they compute every token together "
                             "over --tp-backend (-dp 2 -pp 2 -tp 2 is 8 workers)")
    parser.add_argument("--tp-backend", default="ring", choices=TP_BACKENDS,
                        help="MLX backend of each tensor-parallel group's all-reduces: ring (TCP, default), jaccl "
                             "(RDMA over Thunderbolt 5: macOS 26.2+ with RDMA enabled and MLX_IBV_DEVICES on "
                             "each Mac), nccl (CUDA GPUs)")
    parser.add_argument("--pp-layer-split", default=None,
                        help="first layer of each stage after the first, e.g. 10,20 (default: even split)")
    parser.add_argument("--served-model-name", default=None, help="model name in the API (default: from the model)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion in tokens (default: the model's context length)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS,
                        help="sequences a replica runs at once")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=defaults.ENABLE_PREFIX_CACHING,
                        help="keep finished sequences' KV on every stage and reuse it for prompts that start alike "
                             "(the same system prompt, a conversation's earlier turns); within the KV budget, "
                             "evicted least recently used first (default: on)")
    parser.add_argument("--prefix-cache-block-size", type=int, default=defaults.PREFIX_CACHE_BLOCK_SIZE,
                        help="tokens per prefix-cache block: prefixes are cached and reused in whole blocks "
                             "(default %(default)s)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES + ("fp8",),
                        help="how plain KV layers store keys and values: auto (the compute dtype), q8 or q4 "
                             "(8 or 4-bit codes with a scale and bias per group, mlx-lm's QuantizedKVCache: about "
                             "1.9x or 3.6x the context in the same memory); sliding windows and recurrent state "
                             "stay in the compute dtype. vLLM's fp8 is refused, pointing to q8")
    parser.add_argument("--kv-cache-group-size", type=int, default=DEFAULT_KV_GROUP_SIZE,
                        help="elements per quantization group of q8 / q4 KV: 32, 64 or 128 (default %(default)s, "
                             "mlx-lm's --kv-group-size)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help="speculative decoding, vLLM's flag: e.g. '{\"method\": \"ngram\", "
                             "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' "
                             "proposes tokens from earlier in each sequence, '{\"model\": DIR, "
                             "\"num_speculative_tokens\": 4}' from a small draft model with the target's tokenizer "
                             "(an mlx-lm directory), and verifies them all in one trip through the stages, with the "
                             "same tokens as without it (docs/architecture.md)")
    parser.add_argument("--dtype", default="auto",
                        help="compute dtype: auto (float32 on the CPU backend, float16 on Metal, bfloat16 on "
                             "CUDA), float32, float16, bfloat16")
    parser.add_argument("--hop-transport", default="lane", choices=("lane", "ring"),
                        help="how hidden states travel between stages: after each message's header on the "
                             "stages' TCP lane (default; lowest latency) or over MLX's distributed ring")
    parser.add_argument("--dequantize", default="auto", choices=("auto", "on", "off"),
                        help="run a quantized checkpoint with dense weights: auto does so when the dense weights "
                             "fit half the memory budget, on CUDA (its quantized kernels stall on each new batch "
                             "shape) and on the CPU backend with an optimized BLAS; never on Metal")
    parser.add_argument("--memory-fraction", type=float, default=defaults.MEMORY_FRACTION,
                        help="share of each host's memory (on Metal and CUDA: of its GPU's) its stages may use for "
                             "weights and KV cache (like vLLM's --gpu-memory-utilization)")
    add_load_format_argument(parser)
    parser.add_argument("--shape-layers", type=int, default=None, metavar="N",
                        help="with --load-format dummy: only the model's first N decoder layers (its layer pattern "
                             "kept: dense first layers, sliding and full attention), to run part of a model too big "
                             "for the machine")
    parser.add_argument("--api-key", default=None, help="require this key on /v1 and /api (default $STAGEMESH_API_KEY)")
    parser.add_argument("--ring-base-port", type=int, default=None,
                        help="global stage g binds base+g for the MLX ring (default $STAGEMESH_RING_BASE_PORT "
                             f"or {settings.DEFAULT_RING_BASE_PORT})")
    parser.add_argument("--grpc-base-port", type=int, default=None,
                        help="global stage g binds base+g for gRPC (default $STAGEMESH_GRPC_BASE_PORT or "
                             f"{settings.DEFAULT_GRPC_BASE_PORT})")
    openai_flags.add_arguments(parser)
    parser.add_argument("--startup-timeout", type=float, default=defaults.STARTUP_TIMEOUT_S,
                        help="seconds allowed for every stage to load and join its ring")
    parser.add_argument("--dry-run", action="store_true",
                        help="print the layer plan (as `stagemesh plan` does) and exit without starting a stage")
    add_tp_link_arguments(parser)
    security_flags.add_arguments(parser)


def add_tp_link_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tp-link`` and ``--tp-link-latency-us``: the link a -tp group's plan is costed with (``stagemesh plan``
    and ``stagemesh serve --dry-run``)."""
    parser.add_argument("--tp-link", default=None, metavar="FILE",
                        help="with -tp: the group's link as `stagemesh doctor --tp-link --json > FILE` measured it "
                             "(all-reduce and hop latency, the nodes' memory bandwidth) for the plan's cost of the "
                             "group's all-reduces; default: the backend's assumed latency, printed as an assumption")
    parser.add_argument("--tp-link-latency-us", type=float, default=None, metavar="US",
                        help="with -tp: one all-reduce of a decode row over the group's link, in microseconds, as "
                             "you measured it (instead of --tp-link)")


def resolve_model_argument(model: str | None, load_format: str) -> str:
    """MODEL as a local path, as ``stage_worker.checkpoint.default_model.resolve_model_path`` finds it; with
    ``--load-format dummy`` also the name of a shipped shape (a local path of that name wins)."""
    if load_format != "dummy" or model is None:
        return resolve_model_path(model)
    names = shape_names()
    if model in names and not os.path.exists(os.path.expanduser(model)):
        return str(SHAPES_DIR / model)
    try:
        return resolve_model_path(model)
    except ModelFormatError as exc:
        raise ServeConfigError(
            f"--load-format dummy: model {model!r} is neither a directory with a config.json, a .gguf file, nor a "
            f"known shape (known shapes: {', '.join(names) or 'none installed'})"
        ) from exc


def check_dummy_vocabulary(spec: ModelSpec, tokenizer: Any) -> None:
    """Random weights may come with a borrowed tokenizer; refuse one that encodes ids past the model's
    vocabulary, which would index beyond the embedding."""
    if spec.random_weights and len(tokenizer) > spec.vocab_size:
        raise ServeConfigError(
            f"--load-format dummy: the tokenizer knows {len(tokenizer)} tokens but the model's vocab_size is "
            f"{spec.vocab_size}; raise vocab_size in {spec.path} to at least {len(tokenizer)} or add the model's "
            "own tokenizer files"
        )


def checked_draft(speculative: Any, spec: ModelSpec) -> Any:
    """``--speculative-config`` with its draft model (if any) checked against the target ``spec``
    (``stage_worker.speculation.draft_proposer.check_draft_model``) and its path made absolute for the stages."""
    if speculative is None or speculative.model is None:
        return speculative
    from dataclasses import replace

    from stage_worker.speculation.draft_proposer import check_draft_model

    check_draft_model(speculative.model, spec)
    return replace(speculative, model=os.path.abspath(speculative.model))


class ServeConfigError(UserError):
    """A flag that cannot work; the message names it."""


def check_tensor_parallel(args: argparse.Namespace, spec: ModelSpec) -> None:
    """Refuse a ``-tp`` the model, the hop transport or this host's MLX cannot take, before anything starts."""
    size = args.tensor_parallel_size
    if size == 1:
        return
    from stage_worker.model.stage_model import check_shardable

    if args.hop_transport == "ring":
        raise ServeConfigError("--hop-transport ring cannot carry a tensor-parallel pipeline's hops (a process joins "
                               "one MLX group, and a -tp worker's is its group's): use --hop-transport lane with -tp")
    backend_ready(args.tp_backend)
    check_shardable(spec, size)


def backend_ready(backend: str) -> None:
    """Refuse ``--tp-backend`` where this host's MLX cannot form it (the head decides for the mesh: a node
    without it fails its group's start, naming itself)."""
    import mlx.core as mx

    if backend == "ring":
        return
    if not mx.distributed.is_available(backend):
        need = ("RDMA over Thunderbolt 5: macOS 26.2 or later, `rdma_ctl enable` run once in Recovery, and an MLX "
                "built with it" if backend == "jaccl" else "MLX's CUDA build and NVIDIA GPUs")
        raise ServeConfigError(f"--tp-backend {backend} is not available in this host's MLX: it needs {need}; "
                               "use --tp-backend ring")
    if backend == "nccl" and not mx.cuda.is_available():
        raise ServeConfigError("--tp-backend nccl needs CUDA GPUs, and this host's MLX sees none; use --tp-backend "
                               "ring")


def check_port_free(host: str, port: int, flag: str) -> None:
    if not port_is_free(host, port):
        raise ServeConfigError(f"{flag} {port}: cannot listen on {host}:{port} (in use or not this host's "
                               f"address); stop what uses it or choose another {flag}")


def build_mesh_config(args: argparse.Namespace):
    """Validate every flag against the model and return the coordinator's config (no side effects)."""
    # Lazily: the model readers and the stage's model code bring MLX, the coordinator its Ray glue.
    from coordinator.mesh import MeshConfig
    from stage_worker.checkpoint.checkpoint_check import check_checkpoint
    from stage_worker.checkpoint.mlx_arch import check_kv_cache_dtype
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.model_facts import draft_facts, model_facts
    from stage_worker.model.stage_model import resolve_compute_dtype

    for flag, value in (("--pipeline-parallel-size", args.pipeline_parallel_size),
                        ("--data-parallel-size", args.data_parallel_size),
                        ("--tensor-parallel-size", args.tensor_parallel_size), ("--max-num-seqs", args.max_num_seqs),
                        ("--prefix-cache-block-size", args.prefix_cache_block_size)):
        if value < 1:
            raise ServeConfigError(f"{flag} must be at least 1, got {value}")
    speculative = parse_speculative_config(args.speculative_config) if args.speculative_config else None
    model_path = resolve_model_argument(args.model, args.load_format)
    spec = read_model_spec(model_path, args.load_format, args.shape_layers)
    check_checkpoint(spec)  # files that disagree with the config: named here, not deep in a stage
    speculative = checked_draft(speculative, spec)
    plan_layer_split(spec.num_layers, args.pipeline_parallel_size, args.pp_layer_split)
    check_tensor_parallel(args, spec)
    kv_cache_dtype = parse_kv_cache_dtype(args.kv_cache_dtype, args.kv_cache_group_size)
    check_kv_cache_dtype(spec, kv_cache_dtype)
    resolve_compute_dtype(args.dtype)
    if not 0 < args.memory_fraction <= 1:
        raise ServeConfigError(f"--memory-fraction must be in (0, 1], got {args.memory_fraction}")
    context = int(spec.args.get("max_position_embeddings") or 0)
    max_model_len = args.max_model_len or context or defaults.MAX_MODEL_LEN
    if max_model_len < 2 or (context and max_model_len > context):
        raise ServeConfigError(f"--max-model-len {max_model_len} must be between 2 and the model's context "
                               f"length {context}")
    total = args.pipeline_parallel_size * args.data_parallel_size
    ring_base = args.ring_base_port if args.ring_base_port is not None else settings.RING_BASE_PORT
    grpc_base = args.grpc_base_port if args.grpc_base_port is not None else settings.GRPC_BASE_PORT
    check_port_base("--ring-base-port", ring_base, data_plane_ports(total, args.tensor_parallel_size))
    check_port_base("--grpc-base-port", grpc_base, total * args.tensor_parallel_size)
    security_flags.check_gateway_flags(args)
    if args.ollama_port is not None and not (0 < args.ollama_port <= 65535 and args.ollama_port != args.port):
        raise ServeConfigError(f"--ollama-port {args.ollama_port} must be a TCP port (1-65535) other than --port "
                               f"{args.port}")
    return spec, MeshConfig(
        model_path=model_path,
        model_is_default=args.model is None,
        served_model_name=args.served_model_name or spec.default_served_name,
        num_layers=spec.num_layers,
        pipeline_parallel_size=args.pipeline_parallel_size,
        data_parallel_size=args.data_parallel_size,
        compute_dtype=args.dtype,
        dequantize=args.dequantize,
        hop_transport=args.hop_transport,
        tensor_parallel_size=args.tensor_parallel_size,
        tp_backend=args.tp_backend,
        load_format=args.load_format,
        first_layers=args.shape_layers,
        memory_fraction=args.memory_fraction,
        layer_split=args.pp_layer_split,
        ring_base_port=ring_base,
        grpc_base_port=grpc_base,
        max_num_seqs=args.max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_cache_block_size=args.prefix_cache_block_size,
        kv_cache_dtype=kv_cache_dtype,
        speculative=speculative,
        startup_timeout_s=args.startup_timeout,
        # The layer planner sizes quantized weights unless --dequantize on (auto dequantizes only when the
        # dense weights fit half a stage's budget, so a plan that fits quantized still fits). KV in the compute
        # dtype: MeshConfig.planned_facts counts it as --kv-cache-dtype stores it, and auto's beside it.
        model_facts=model_facts(spec, dense=args.dequantize == "on"),
        draft_facts=draft_facts(speculative, spec, args.max_num_seqs, dense=args.dequantize == "on"),
        mesh_token=security_flags.mesh_token(args),
        grpc_tls=security_flags.grpc_tls(args),
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        stream=sys.stderr)
    # Lazily: the gateway (FastAPI, transformers), the coordinator (Ray) and MLX load only to serve.
    import uvicorn

    from coordinator.mesh import MeshCoordinator, MeshStartError
    from coordinator.placement import PlacementError
    from gateway.app import GatewayConfig, create_app
    from stage_worker.checkpoint.tokenizer import eos_token_ids, load_tokenizer
    from stagemesh.model_card import model_card

    try:
        if not getattr(args, "dry_run", False) and (args.tp_link or args.tp_link_latency_us is not None):
            # Only the plan reads the link's figures; a serving mesh would drop them without a word.
            raise ServeConfigError("--tp-link and --tp-link-latency-us cost a -tp plan: use them with --dry-run "
                                   "or `stagemesh plan`")
        spec, config = build_mesh_config(args)
        check_port_free(args.host, args.port, "--port")
        if args.ollama_port is not None:
            check_port_free(args.host, args.ollama_port, "--ollama-port")
        openai = openai_flags.openai_defaults(args, spec.path)
    except ValueError as exc:  # ServeConfigError, LayerSplitError, PortRangeError, ModelFormatError, --dtype
        print(f"stagemesh serve: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "dry_run", False):
        from stagemesh.plan_report import print_plan, tp_link_for  # the coordinator's planning code: dry run only

        try:
            link = tp_link_for(args, config.tensor_parallel_size, config.tp_backend)
        except UserError as exc:
            print(f"stagemesh serve: error: {exc}", file=sys.stderr)
            return 2
        return print_plan(config, as_json=False, link=link, spec=spec)
    tokenizer = load_tokenizer(spec)
    check_dummy_vocabulary(spec, tokenizer)
    coordinator = MeshCoordinator(config)
    try:
        coordinator.start()
    except KeyboardInterrupt:
        coordinator.stop()
        return 130
    except UserError as exc:  # the layer plan does not fit: refused before any stage loads
        print(f"stagemesh serve: error: {exc}", file=sys.stderr)
        coordinator.stop()
        return 2
    except PlacementError as exc:  # more workers than the cluster has mlx units: refused before any loads
        print(f"stagemesh serve: error: {exc}", file=sys.stderr)
        coordinator.stop()
        return 2
    except MeshStartError as exc:
        # A stage that cannot load or join its pipeline at start is the model's or the flags' fault, never
        # retried (only a replica that has served is restarted): a configuration error, like the checks above.
        print(f"stagemesh serve: the mesh did not start: {exc}", file=sys.stderr)
        coordinator.stop()
        return 2
    except Exception as exc:  # startup failed for another reason (Ray, the host): report it, leave nothing running
        print(f"stagemesh serve: the mesh did not start: {exc}", file=sys.stderr)
        coordinator.stop()
        return 1
    app = create_app(
        GatewayConfig(served_model_name=config.served_model_name, max_model_len=config.max_model_len,
                      mesh_token=coordinator.mesh_token, grpc_tls=config.grpc_tls, openai=openai,
                      model_card=model_card(spec), ollama_port=args.ollama_port or 0,
                      prefix_routing_block_size=args.prefix_cache_block_size if args.enable_prefix_caching else None,
                      **security_flags.gateway_options(args)),
        mesh=coordinator,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(spec, tokenizer),
    )
    listen: dict[str, Any] = dict(host=args.host, log_level="info", timeout_graceful_shutdown=5,
                                  **security_flags.uvicorn_tls(args))
    gateway = uvicorn.Config(app, port=args.port, **listen)
    server = uvicorn.Server(gateway)
    log.info("gateway on %s://%s:%d (model %s)", security_flags.scheme(args), args.host, args.port,
             config.served_model_name)
    # --ollama-port: one server, one app, two listening sockets (the app tells them apart by the port a request
    # arrived on, for Ollama's GET /).
    sockets = None
    if args.ollama_port is not None:
        sockets = [gateway.bind_socket(), uvicorn.Config(app, port=args.ollama_port, **listen).bind_socket()]
        log.info("Ollama's API also on %s://%s:%d", security_flags.scheme(args), args.host, args.ollama_port)
    try:
        server.run(sockets=sockets)  # returns after Ctrl-C / SIGTERM, then re-raises the signal it captured
    except SystemExit as exc:
        # Ray's driver turns a re-raised SIGTERM into SystemExit(15); the shutdown is orderly, so exit 0.
        if exc.code != signal.SIGTERM:
            raise
    finally:
        coordinator.stop()
    return 0
