"""``stagemesh bench compare``: the standing comparisons, each side by side in one ``stagemesh bench serve`` run.

Starts every server of a comparison on loopback, lets ``stagemesh bench serve`` load them alternately (same
prompts, same concurrency levels), stops them, and writes its report (JSON) + PNG under ``--output-dir``.
The comparisons (``--comparisons``): ``stock`` and ``matched``, stagemesh serve against ``mlx_lm.server`` on
the GGUF converted for it (as it comes; then on the same dense float32 weights and optimized BLAS as our
stages); ``mlx-lm``, the same on any checkpoint with nothing preloaded (the GPU comparison); ``pp`` (PP=2 vs
PP=1); ``two-hosts`` (PP=2, each stage pinned to its own core, vs PP=1 on one core); ``gpus`` (PP=1 vs PP=2
and DP=2 on two GPUs); ``gpus-pp`` (PP=2 with and without building steps ahead); ``fused`` (projections
joined or not); ``prefix`` (prefix cache off, on, and ``mlx_lm.server``'s prompt cache, on multi-turn chat
and on distinct prompts; ``prefix-summary.json`` checks its ratios against their targets); ``tp`` (-tp 1, -pp 2,
-tp 2 and ``bench tensor``'s split and ceiling); ``kv-cache-dtype`` (auto, q8 and q4 on long prompts, with each
server's KV token capacity). ``--shape NAME`` serves a real-sized model with random weights; a model directory
as MODEL is served as it is (``stock`` and ``matched`` then refuse). ``--bare`` adds the bare batched forward.
The report lists every run with its report's path, whether every request succeeded, and its ratios.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from stagemesh.bench import flags
from stagemesh.bench.random_checkpoint import check_shape_flags, shape_description, write_shape_checkpoint
from stagemesh_core import defaults
from stagemesh_core.errors import UserError

COMPARISONS = ("stock", "matched", "pp", "two-hosts", "mlx-lm", "gpus", "gpus-pp", "fused", "prefix", "tp",
               "kv-cache-dtype")
# ``tp``'s every worker on one BLAS thread: each stands for one Mac (``stagemesh bench tensor`` does the same).
TP_ENV = {"STAGEMESH_BLAS_THREADS": "1"}
# Those that serve mlx_lm the GGUF converted to an mlx-lm directory: they need MODEL to be a .gguf file.
GGUF_COMPARISONS = ("stock", "matched")
# Sizes when a flag is not given: (input, output, prompts per level) for most comparisons; for ``prefix``
# a first turn's length in, few tokens out (its point is the time to first token), two prompts per stream.
DEFAULT_SIZES = (32, 48, None)  # None: stagemesh bench serve's own per level, 4 x its concurrency (at least 16)
PREFIX_OUTPUT_LEN = 16
DEFAULT_CONCURRENCY = "1,16"
# ``kv-cache-dtype``: quantized KV's cost shows where attention reads many positions, so long prompts, and 8
# streams rather than 16 (eight 1,088-token sequences already fill what a CPU runs in a few minutes).
KV_DTYPE_SIZES = (1024, 64, None)
KV_DTYPE_CONCURRENCY = "1,8"
KV_CACHE_DTYPES = ("auto", "q8", "q4")  # auto first: every ratio is taken against it
LOG_TAIL_LINES = 15  # of a server's log, shown when it exits or never comes up


@dataclass(frozen=True)
class Endpoint:
    """A server under test."""

    url: str
    label: str
    model: str
    pid: int
    stagemesh: bool


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_model_argument(parser, "a GGUF file, converted for mlx_lm.server")
    parser.add_argument("--comparisons", default=",".join(COMPARISONS),
                        help=f"which to run, comma-separated from {', '.join(COMPARISONS)}")
    flags.add_concurrency(parser, None, f"default {DEFAULT_CONCURRENCY}; kv-cache-dtype: {KV_DTYPE_CONCURRENCY}")
    flags.add_num_prompts(parser, None, "default 4 x the level's concurrency, at least 16, so a level is several "
                                        "waves of requests rather than one whose first token and tail dominate; "
                                        "prefix: 2 x --conversations")
    flags.add_lengths(parser, input_len=None, output_len=None,
                      input_note=f"default {DEFAULT_SIZES[0]}; prefix: --system-len + --user-len; "
                                 f"kv-cache-dtype: {KV_DTYPE_SIZES[0]}",
                      output_note=f"default {DEFAULT_SIZES[1]}; prefix: {PREFIX_OUTPUT_LEN}; "
                                  f"kv-cache-dtype: {KV_DTYPE_SIZES[1]}")
    pf = parser.add_argument_group("prefix comparison")
    pf.add_argument("--conversations", type=int, default=8,
                    help="multi-turn conversations at once, and distinct-prompt streams (default %(default)s)")
    pf.add_argument("--system-len", type=int, default=128, help="shared system prompt tokens (default %(default)s)")
    pf.add_argument("--user-len", type=int, default=16, help="tokens of each user turn (default %(default)s)")
    pf.add_argument("--turns", type=int, default=3, help="turns per conversation (default %(default)s)")
    flags.add_rounds(parser, 2)
    flags.add_seed(parser)
    flags.add_port_base(parser, 28000, "ten for each server under test")
    parser.add_argument("--output-dir", default="bench-results", metavar="DIR",
                        help="directory for each run's report and figure, the profiles and server logs "
                             "(default %(default)s)")
    flags.add_shape_flags(parser)
    flags.add_serve_args(parser)
    parser.add_argument("--bare", action="store_true",
                        help="also measure the bare batched forward of the same weights at each concurrency")
    parser.add_argument("--profile-concurrency", default="16",
                        help="after each comparison, load every stagemesh server alone at each of these "
                             "concurrencies (comma-separated) and report where each stage's time went and the "
                             "gateway's CPU per token (0: skip)")


def run(args: argparse.Namespace) -> int:
    from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir
    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.model.blas import find_optimized_blas
    from stagemesh.bench.report import build_report, emit, flags_of, now

    started_at = now()
    chosen = [c.strip() for c in args.comparisons.split(",") if c.strip()]
    unknown = set(chosen) - set(COMPARISONS)
    if unknown:
        raise UserError(f"--comparisons: unknown {sorted(unknown)}; choose from {', '.join(COMPARISONS)}")
    check_shape_flags(args)
    if "prefix" in chosen:  # before any server starts (stagemesh bench serve checks the rest, e.g. the lengths)
        for flag, value in (("--conversations", args.conversations), ("--system-len", args.system_len),
                            ("--user-len", args.user_len), ("--turns", args.turns)):
            if value < 1:
                raise UserError(f"{flag} must be at least 1; got {value}")
    model = None if args.shape else resolve_model_path(args.model)
    # A model directory (or the --shape checkpoint) is what mlx_lm.server reads as it is; the GGUF comparisons
    # need a .gguf to convert.
    as_is = bool(args.shape) or (model is not None and Path(model).is_dir())
    needs_gguf = sorted(set(chosen) & set(GGUF_COMPARISONS)) if as_is else []
    if needs_gguf:
        raise UserError(f"--comparisons {','.join(needs_gguf)} compare against the GGUF converted for mlx_lm; "
                        f"{args.shape or model} is not a .gguf file: pass one, or choose from "
                        f"{', '.join(c for c in COMPARISONS if c not in GGUF_COMPARISONS)}")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    blas = find_optimized_blas()
    runs: list[dict] = []
    prefix_summary = None
    bare = None
    serve_args = args.serve_args.split()
    with tempfile.TemporaryDirectory(prefix="stagemesh-bench-compare-") as tmp:
        if args.shape:
            started = time.monotonic()
            model = write_shape_checkpoint(args, Path(tmp))
            print(f"{args.shape}: {shape_description(args)} checkpoint in {time.monotonic() - started:.0f} s",
                  file=sys.stderr)
            tokenizer_dir = model
        else:
            assert model is not None
            tokenizer_dir = model if as_is else convert_gguf_to_mlx_dir(model, str(Path(tmp) / "q4"))
        ports = iter(range(args.port_base, args.port_base + 1000, 10))
        for name in chosen:
            with contextlib.ExitStack() as stack:
                endpoints = _start_comparison(name, stack, model, tokenizer_dir, tmp, blas, ports, serve_args,
                                              as_is=as_is, log_dir=out / "logs")
                if name == "prefix":
                    prefix_runs, prefix_summary = _bench_prefix(args, endpoints, out, tokenizer_dir)
                    runs += prefix_runs
                    continue
                runs.append(_bench(args, name, endpoints, out, tokenizer_dir))
                if name == "kv-cache-dtype":
                    runs[-1]["kv_token_capacity"] = {e.label: kv_token_capacity(e.url) for e in endpoints}
                if name == "tp":
                    runs[-1]["tensor"] = _tensor_split(model, out)
                if _profile_levels(args):
                    runs[-1]["profile"] = _profile(args, name, endpoints, out, tokenizer_dir)
        if args.bare:
            bare = _bare(args, model, out)
    report = build_report("compare", started_at=started_at, local_mlx=True,
                          config={**flags_of(args), "model": args.shape or model},
                          results={"runs": [{k: v for k, v in r.items() if k != "ratios"} for r in runs],
                                   "bare": bare, "prefix": prefix_summary},
                          ratios=[{"run": r["name"], **ratio} for r in runs for ratio in r["ratios"]])
    emit(report, args, format_compare(report))
    return 0 if all(r["ok"] for r in runs) else 1


def format_compare(report: dict) -> str:
    """Each run: its endpoints, whether every request succeeded, where its report is, its ratios (pure)."""
    from stagemesh.bench.serve_report import format_ratios

    lines: list[str] = []
    for run in report["results"]["runs"]:
        state = "ok" if run["ok"] else "FAILED requests (see its report)"
        lines += [f"== {run['name']}: {' vs '.join(run['endpoints'])}: {state}; report {run['report']}"]
        lines += format_ratios([r for r in report["ratios"] if r["run"] == run["name"]])
        if run.get("kv_token_capacity"):
            lines += format_kv_capacity(run["kv_token_capacity"])
    prefix = report["results"]["prefix"]
    for target in (prefix or {}).get("targets", ()):
        met = {True: "met", False: "NOT met", None: "unknown"}[target["met"]]
        lines.append(f"prefix target: {target['name']} = {target['value']} ({target['target']}): {met}")
    return "\n".join(lines)


def _bare(args: argparse.Namespace, model: str, out: Path) -> dict:
    """The bare batched forward of the same weights at every concurrency level (the device's limit), as
    ``stagemesh bench pipeline --bare N,N`` measures it."""
    from coordinator.stage_host import nvidia_smi_list
    from stage_worker.service.process_setup import SERVING_MLX_CUDA_DEFAULTS
    from stagemesh.bench.pipeline import bare_forward
    from stagemesh_core.gpus import node_gpu_count

    levels = [int(c) for c in _concurrency(args, "bare").split(",") if c.strip()]
    input_len, output_len, _ = _sizes(args, "bare")
    bare = {f"batch{n}": bare_forward(model, n, 32, "auto", input_len, output_len) for n in levels}
    if node_gpu_count(os.environ, nvidia_smi_list(os.environ)):
        # The same forward with the MLX CUDA settings a stage serves with (no CUDA graphs, no cuDNN attention):
        # what separates the bare arm from a stage's step before any serving work.
        bare |= {f"batch{n}_serving_settings": bare_forward(model, n, 32, "auto", input_len, output_len,
                                                            SERVING_MLX_CUDA_DEFAULTS) for n in levels}
    (out / "bare.json").write_text(json.dumps(bare, indent=1))
    for key, value in bare.items():
        print(f"bare {key}: decode {value['decode_tokens_per_s']:.1f} tok/s, whole workload "
              f"{value['workload_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    return bare


@dataclass(frozen=True)
class ServerSpec:
    """One server of a comparison, before it starts: ``stagemesh serve`` with ``flags``, or ``mlx_lm.server``."""

    label: str
    model: str
    flags: tuple[str, ...] = ()  # stagemesh serve's own flags; none for mlx_lm.server
    env: tuple[tuple[str, str], ...] = ()  # added to the environment
    mlx_lm: bool = False
    pin: str | None = None  # STAGEMESH_PIN_CORES (two-hosts)


def comparison_servers(name: str, model: str, q4_dir: str, dense_f32: Callable[[], str], blas: str | None,
                       serve_args: Sequence[str] = (), as_is: bool = False, backend: str = "cpu",
                       ncpu: int = 1) -> list[ServerSpec]:
    """The servers of comparison ``name``, in the order they start, the first the one every ratio is taken
    against (pure but for ``dense_f32``, which makes the dense float32 checkpoint once when a server needs it):

    - ``stock``: stagemesh serve (defaults) vs stock ``mlx_lm.server`` on the same checkpoint converted to an
      mlx-lm directory (4-bit layers, 8-bit embedding, MLX's bundled reference BLAS): what a user gets out of
      the box;
    - ``matched``: the same two, but mlx_lm.server on the same dense float32 weights with the same optimized
      BLAS preloaded as our stages;
    - ``mlx-lm``: stagemesh serve (defaults) vs ``mlx_lm.server`` on the same checkpoint, nothing preloaded;
    - ``pp``: PP=1 vs PP=2 on this host;
    - ``two-hosts``: PP=1 pinned to one core vs PP=2 over two "hosts" (each stage pinned to its own core): the
      throughput a second host adds;
    - ``gpus``: on a host with two GPUs, PP=1 (one GPU) vs PP=2 and DP=2 (each stage on its own GPU): what a
      second GPU adds as a stage or as a replica;
    - ``gpus-pp``: PP=1 vs PP=2 over two GPUs, and PP=2 again with ``STAGEMESH_STEP_AHEAD=off`` (each stage
      builds a step only once its input is there): what building ahead is worth;
    - ``tp``: -tp 1 vs -pp 2 vs -tp 2 on this host, every worker on one BLAS thread (each standing for one
      Mac): what a second Mac adds to one stream as a pipeline stage or as half of a tensor-parallel stage;
    - ``fused``: PP=1 with each layer's q/k/v and gate/up projections joined (``STAGEMESH_FUSE_PROJECTIONS=on``)
      vs ``off`` (mlx-lm's layers as they are): what joining them is worth;
    - ``prefix``: stagemesh with the prefix cache off (``--no-enable-prefix-caching``, the baseline), on (the
      default), and ``mlx_lm.server`` with its prompt cache (on by default) on the same weights;
    - ``kv-cache-dtype``: ``--kv-cache-dtype`` auto (the baseline), q8 and q4 (``kv_cache_dtype_servers``):
      what storing keys and values quantized costs in speed, beside the context it buys."""
    serve = tuple(serve_args)
    same_blas = (("LD_PRELOAD", blas), ("OPENBLAS_NUM_THREADS", str(ncpu))) if blas else ()
    tp_env = tuple(TP_ENV.items())
    if name == "prefix":
        # Cache off first: the baseline every ratio is taken against. mlx_lm.server reads an mlx-lm
        # directory: MODEL's or the --shape checkpoint itself; else, as for ``matched``, the same dense float32
        # weights with the same BLAS as our stages (stock mlx_lm here is far slower for reasons that have
        # nothing to do with caching, which would make "no worse than mlx_lm" say nothing; docs/performance.md
        # has the figures). On a CPU host mlx_lm.server gets our stages' BLAS also for a model it reads as it is
        # (a --shape checkpoint): without it a long prompt's prefill is about ten times slower there, which
        # again says nothing about its prompt cache.
        reference = model if as_is else dense_f32()
        cpu_blas = not as_is or backend == "cpu"
        return [
            # The flag last: it wins over anything --serve-args says about the cache.
            ServerSpec("stagemesh-cache-off", model, (*serve, "--no-enable-prefix-caching")),
            ServerSpec("stagemesh", model, serve),
            ServerSpec("mlx_lm", reference, env=same_blas if cpu_blas else (), mlx_lm=True),
        ]
    if name == "kv-cache-dtype":
        return [ServerSpec(label, model, tuple(flags)) for label, flags in kv_cache_dtype_servers(list(serve))]
    if name == "mlx-lm":
        return [ServerSpec("stagemesh", model, serve), ServerSpec("mlx_lm", model, mlx_lm=True)]
    if name == "stock":
        return [ServerSpec("stagemesh", model), ServerSpec("mlx_lm-q4-refblas", q4_dir, mlx_lm=True)]
    if name == "matched":
        return [ServerSpec("stagemesh", model),
                ServerSpec("mlx_lm-f32-same-blas", dense_f32(), env=same_blas, mlx_lm=True)]
    if name == "pp":
        return [ServerSpec("pp1", model, ("-pp", "1", *serve)), ServerSpec("pp2", model, ("-pp", "2", *serve))]
    if name == "gpus":
        return [ServerSpec("pp1", model, ("-pp", "1", *serve)), ServerSpec("pp2", model, ("-pp", "2", *serve)),
                ServerSpec("dp2", model, ("-dp", "2", *serve))]
    if name == "gpus-pp":
        return [ServerSpec("pp1", model, ("-pp", "1", *serve)), ServerSpec("pp2", model, ("-pp", "2", *serve)),
                ServerSpec("pp2-step-ahead-off", model, ("-pp", "2", *serve),
                           env=(("STAGEMESH_STEP_AHEAD", "off"),))]
    if name == "tp":
        return [ServerSpec("tp1", model, ("-tp", "1", *serve), env=tp_env),
                ServerSpec("pp2", model, ("-pp", "2", *serve), env=tp_env),
                ServerSpec("tp2", model, ("-tp", "2", *serve), env=tp_env)]
    if name == "fused":
        return [ServerSpec("pp1", model, ("-pp", "1", *serve), env=(("STAGEMESH_FUSE_PROJECTIONS", "on"),)),
                ServerSpec("pp1-unfused", model, ("-pp", "1", *serve), env=(("STAGEMESH_FUSE_PROJECTIONS", "off"),))]
    if name == "two-hosts":
        # Each "host" is one core: stage g pinned to core g; the one-host reference on core 0.
        return [ServerSpec("one-host", model, ("-pp", "1"), pin="0"),
                ServerSpec("two-hosts", model, ("-pp", "2"), pin="per-stage")]
    raise ValueError(name)


def share_the_gpu(servers: list[ServerSpec], backend: str) -> list[ServerSpec]:
    """``servers`` with each stagemesh serve given an equal share of ``--memory-fraction``'s default where
    they run side by side on a GPU (pure). Every serve plans its weights and KV within its fraction of the
    device, and its stages hold MLX to that budget; several serves each taking the whole default would
    together ask for more than the GPU has, and a GPU's memory is not paged: the first step that does not
    fit fails. mlx_lm.server has no such limit and takes what it needs from what the shares leave. A
    ``--memory-fraction`` in ``--serve-args`` wins; the CPU's host pages memory and keeps the default."""
    if backend not in ("cuda", "metal") or len(servers) < 2:
        return servers
    if any("--memory-fraction" in s.flags or any(f.startswith("--memory-fraction=") for f in s.flags)
           for s in servers):
        return servers
    share = f"{int(defaults.MEMORY_FRACTION / len(servers) * 100) / 100:g}"
    return [s if s.mlx_lm else replace(s, flags=(*s.flags, "--memory-fraction", share)) for s in servers]


def _start_comparison(name, stack, model, q4_dir, tmp, blas, ports, serve_args=(), as_is=False,
                      log_dir: Path | None = None) -> list[Endpoint]:
    """``comparison_servers``, shared on a GPU (``share_the_gpu``), started on ``stack`` in their order."""
    from stage_worker.model.device import current_backend

    backend = current_backend()
    servers = share_the_gpu(comparison_servers(name, model, q4_dir, lambda: _dense_f32_dir(q4_dir, tmp), blas,
                                               serve_args, as_is, backend, os.cpu_count() or 1), backend)
    if any(s.pin for s in servers) and (not shutil.which("taskset") or (os.cpu_count() or 1) < 2):
        raise SystemExit("two-hosts needs taskset and at least 2 cores")
    endpoints = []
    for server in servers:
        if server.mlx_lm:
            started = _mlx_lm(server.model, next(ports), dict(server.env), server.label, log_dir=log_dir)
        else:
            started = _stagemesh_server(server.model, next(ports), list(server.flags), server.label, pin=server.pin,
                                        log_dir=log_dir, extra_env=dict(server.env))
        endpoints.append(stack.enter_context(started))
    return endpoints


def _tensor_split(model: str, out: Path) -> dict | None:
    """``stagemesh bench tensor`` on the same model, right after the served arms: the group's step split into
    compute and all-reduce, and this machine's ceiling (two processes streaming half the weights each against one
    streaming all), at 1 and 16 rows; None (its log says why) if it failed."""
    report = out / "tp-tensor.json"
    command = [sys.executable, "-m", "stagemesh.cli", "bench", "tensor", model, "--rows", "1,16", "--output",
               str(report)]
    print("== tp: the group's compute and all-reduce, and this machine's ceiling", file=sys.stderr)
    if subprocess.run(command, stdout=sys.stderr).returncode != 0 or not report.exists():
        return None
    return json.loads(report.read_text())["results"]


def _dense_f32_dir(q4_dir: str, tmp: str) -> str:
    """The converted checkpoint dequantized to float32 (what our stages compute with here), made once."""
    f32_dir = str(Path(tmp) / "f32")
    if not Path(f32_dir).exists():
        subprocess.run([sys.executable, "-m", "mlx_lm", "convert", "--hf-path", q4_dir, "--mlx-path", f32_dir,
                        "--dequantize", "--dtype", "float32"], check=True, capture_output=True)
    return f32_dir


@contextlib.contextmanager
def _stagemesh_server(
    model: str, port: int, flags: list[str], label: str, pin: str | None = None, log_dir: Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> Iterator[Endpoint]:
    env = {**os.environ, **(extra_env or {})}
    env.pop("RAY_ADDRESS", None)
    if pin == "per-stage":
        env["STAGEMESH_PIN_CORES"] = "per-stage"
    elif pin is not None:
        env["STAGEMESH_PIN_CORES"] = pin
    command = [sys.executable, "-m", "stagemesh.cli", "serve", model, "--served-model-name", "stagemesh-bench",
               "--port", str(port),
               "--grpc-base-port", str(port + 1), "--ring-base-port", str(port + 5), *flags]
    if pin is not None:
        command = ["taskset", "-c", "0", *command]  # the gateway, coordinator and Ray live on host A's core
    with _server(command, env, f"http://127.0.0.1:{port}", label, "stagemesh-bench", stagemesh=True,
                 log_dir=log_dir) as endpoint:
        yield endpoint


@contextlib.contextmanager
def _mlx_lm(model_dir: str, port: int, extra_env: dict, label: str, log_dir: Path | None = None) -> Iterator[Endpoint]:
    env = {**os.environ, **extra_env}
    command = [sys.executable, "-m", "mlx_lm", "server", "--model", model_dir, "--port", str(port)]
    # mlx_lm.server lists only Hugging Face cache entries; it serves its --model under that path.
    with _server(command, env, f"http://127.0.0.1:{port}", label, model_dir, log_dir=log_dir) as endpoint:
        yield endpoint


@contextlib.contextmanager
def _server(command: list[str], env: dict, url: str, label: str, model: str,
            stagemesh: bool = False, log_dir: Path | None = None) -> Iterator[Endpoint]:
    with server_process(command, label, f"{url}/health", env=env, startup_s=300, poll_s=1,
                        log_dir=log_dir) as process:
        print(f"{label} up at {url}", file=sys.stderr)
        yield Endpoint(url, label, model, process.pid, stagemesh)


def log_tail(path: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` lines of the log at ``path``: a server's own reason for exiting, shown where the run
    ends, since a benchmark's temporary log directory goes with it."""
    with open(path, errors="replace") as log:
        return "".join(collections.deque(log, maxlen=lines))


@contextlib.contextmanager
def server_process(command: list[str], label: str, health_url: str | None, *, env: dict | None = None,
                   startup_s: float = 300, poll_s: float = 1, stop_s: float = 60,
                   log_dir: Path | None = None) -> Iterator[subprocess.Popen]:
    """A benchmark's server in its own process group, logged to a file in ``log_dir`` (kept with the
    results, so a server's own error explains failed requests; default a temporary file, removed after a run
    that raised nothing and kept, by name in the error, otherwise): yielded once
    ``health_url`` answers 200 (at once when None), stopped afterwards (SIGTERM to it, then after it exits or
    ``stop_s`` passes SIGKILL to its process group, children included). A server that exits or stays down
    ``startup_s`` ends the run, with its log's last lines."""
    import httpx

    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    log = tempfile.NamedTemporaryFile("w", prefix=f"bench-{label.replace(' ', '-')}-", suffix=".log",
                                      delete=False, dir=log_dir)
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    went_well = False
    try:
        deadline = time.monotonic() + startup_s
        while health_url is not None:
            if process.poll() is not None:
                raise SystemExit(f"{label} exited ({process.returncode}); see {log.name}, which ends:\n"
                                 + log_tail(log.name))
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise SystemExit(f"{label} did not come up in {startup_s:g} s; see {log.name}, which ends:\n"
                                 + log_tail(log.name))
            time.sleep(poll_s)
        yield process
        went_well = True
    finally:
        # SIGTERM to the server alone, as a service manager stops it: the whole group would also kill the local
        # Ray daemons a stagemesh serve started, and its own orderly stop would then wait on them.
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(stop_s)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)  # whatever it left behind
        process.wait()
        log.close()
        if log_dir is None and went_well:
            os.unlink(log.name)  # a temporary log of a run that went well explains nothing


def kv_cache_dtype_servers(serve_args: list[str]) -> list[tuple[str, list[str]]]:
    """(label, serve flags) of the ``kv-cache-dtype`` comparison's servers, auto first (pure). The dtype flag
    comes last, so it wins over one ``--serve-args`` gives (``--kv-cache-group-size`` there applies to both
    quantized servers)."""
    return [(f"kv-{name}", [*serve_args, "--kv-cache-dtype", name]) for name in KV_CACHE_DTYPES]


def kv_token_capacity(url: str) -> int | None:
    """The pipeline's KV capacity in token positions as a stagemesh gateway's ``/metrics`` reports it: the
    smallest stage's ``stagemesh_stage_kv_token_capacity`` (every stage holds every running position); None
    when it cannot be read (the run goes on without it)."""
    families = _metric_families(url)
    return None if families is None else capacity_from_metrics(families)


def _metric_families(url: str) -> list | None:
    """A stagemesh gateway's ``/metrics``, parsed; None (said on stderr) when it cannot be read."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        print(f"cannot read {url}/metrics: {exc}", file=sys.stderr)
        return None
    return list(text_string_to_metric_families(text))


def capacity_from_metrics(families) -> int | None:
    """The smallest stage's KV token capacity among parsed ``/metrics`` families (pure); None without one."""
    values = [sample.value for family in families if family.name == "stagemesh_stage_kv_token_capacity"
              for sample in family.samples if sample.name == family.name]
    return int(min(values)) if values else None


def format_kv_capacity(capacity: dict[str, int | None]) -> list[str]:
    """Each server's KV token capacity and its ratio to the first's (the baseline) (pure)."""
    labels = list(capacity)
    base = capacity[labels[0]]
    lines = []
    for label in labels:
        tokens = capacity[label]
        ratio = f", {tokens / base:.2f}x of {labels[0]}" if tokens and base and label != labels[0] else ""
        lines.append(f"{label}: KV for {tokens:,} tokens{ratio}" if tokens else f"{label}: KV capacity unknown")
    return lines


def _concurrency(args: argparse.Namespace, name: str) -> str:
    """The concurrency levels of a comparison: ``--concurrency``, else its default."""
    if args.concurrency is not None:
        return args.concurrency
    return KV_DTYPE_CONCURRENCY if name == "kv-cache-dtype" else DEFAULT_CONCURRENCY


def _sizes(args: argparse.Namespace, name: str) -> tuple[int, int, int | None]:
    """(input, output, prompts per level) of a comparison: the flags, else its defaults (prompts None:
    ``stagemesh bench serve`` picks them per level)."""
    defaults: tuple[int, int, int | None]
    if name == "prefix":
        defaults = (args.system_len + args.user_len, PREFIX_OUTPUT_LEN, 2 * args.conversations)
    elif name == "kv-cache-dtype":
        defaults = KV_DTYPE_SIZES
    else:
        defaults = DEFAULT_SIZES
    input_len = defaults[0] if args.input_len is None else args.input_len
    output_len = defaults[1] if args.output_len is None else args.output_len
    num_prompts = defaults[2] if args.num_prompts is None else args.num_prompts
    return input_len, output_len, num_prompts


def _bench(args, name: str, endpoints: list[Endpoint], out: Path, tokenizer_dir: str,
           workload: list[str] | None = None) -> dict:
    """One ``stagemesh bench serve`` run over ``endpoints`` into ``out/NAME.json`` (+ PNG); ``workload``: its
    workload and load flags (default: the synthetic prompts at ``--concurrency``). Its table goes to stderr
    with the rest of the progress; returns the run's entry of the report, its ratios included."""
    input_len, output_len, num_prompts = _sizes(args, name)
    if workload is None:
        workload = ["--concurrency", _concurrency(args, name), "--input-len", str(input_len),
                    *(["--num-prompts", str(num_prompts)] if num_prompts is not None else [])]
    report = out / f"{name}.json"
    command = [sys.executable, "-m", "stagemesh.cli", "bench", "serve", *workload, "--output-len", str(output_len),
               "--rounds", str(args.rounds), "--warmup", "2", "--seed", str(args.seed),
               "--tokenizer", tokenizer_dir, "--output", str(report), "--plot", str(out / f"{name}.png")]
    for endpoint in endpoints:
        command += ["--base-url", endpoint.url, "--label", endpoint.label, "--model", endpoint.model]
    print(f"== {name}: {' vs '.join(e.label for e in endpoints)}", file=sys.stderr)
    result = subprocess.run(command, stdout=sys.stderr)
    ratios = json.loads(report.read_text())["ratios"] if report.exists() else []
    return {"name": name, "endpoints": [e.label for e in endpoints], "report": str(report),
            "ok": result.returncode == 0, "ratios": ratios}


def _bench_prefix(args, endpoints: list[Endpoint], out: Path, tokenizer_dir: str) -> tuple[list[dict], dict | None]:
    """The ``prefix`` comparison: ``--conversations`` multi-turn chat conversations at once (``stagemesh bench
    serve --workload multi-turn``: ``--system-len``, ``--user-len``, ``--turns``), then as many streams of
    distinct prompts (what the cache costs when it never hits), then the summary. Writes
    ``prefix-multi-turn.json``, ``prefix-distinct.json`` (+ PNG) and ``prefix-summary.json``
    (``prefix_summary.summarize``: the ratios against their targets, and the prefix-cache counters each
    stagemesh server's ``/metrics`` reported after each workload); returns the runs and that summary."""
    from stagemesh.bench.prefix_summary import summarize

    conversations = str(args.conversations)
    runs = [_bench(args, "prefix-multi-turn", endpoints, out, tokenizer_dir, [
        "--workload", "multi-turn", "--concurrency", conversations, "--system-len", str(args.system_len),
        "--user-len", str(args.user_len), "--turns", str(args.turns)])]
    # Counters are cumulative since each server started: after the distinct run they include the multi-turn one.
    counters = {"multi-turn": {e.label: prefix_cache_counters(e.url) for e in endpoints if e.stagemesh}}
    input_len, _, num_prompts = _sizes(args, "prefix")
    runs.append(_bench(args, "prefix-distinct", endpoints, out, tokenizer_dir, [
        "--concurrency", conversations, "--num-prompts", str(num_prompts), "--input-len", str(input_len)]))
    counters["distinct"] = {e.label: prefix_cache_counters(e.url) for e in endpoints if e.stagemesh}
    docs = [out / f"prefix-{part}.json" for part in ("multi-turn", "distinct")]
    if not all(doc.exists() for doc in docs):
        return runs, None
    summary = summarize(*(json.loads(doc.read_text()) for doc in docs), counters=counters,
                        baseline="stagemesh-cache-off", cached="stagemesh", reference="mlx_lm")
    (out / "prefix-summary.json").write_text(json.dumps(summary, indent=1))
    return runs, summary


def prefix_cache_counters(url: str) -> dict[str, float]:
    """The prefix-cache counters a stagemesh gateway's ``/metrics`` reports, summed over its stages
    (empty when it cannot be read: the summary then lacks them, the run goes on)."""
    totals: dict[str, float] = {}
    for family in _metric_families(url) or ():
        if family.name.startswith("stagemesh_stage_prefix_cache_"):
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def _profile_levels(args: argparse.Namespace) -> list[int]:
    """The ``--profile-concurrency`` levels; none for ``0``."""
    try:
        levels = [int(level) for level in str(args.profile_concurrency).split(",") if level.strip()]
    except ValueError:
        raise SystemExit(f"--profile-concurrency: comma-separated integers, got {args.profile_concurrency!r}") from None
    return [level for level in levels if level > 0]


def _profile(args, name: str, endpoints: list[Endpoint], out: Path, tokenizer_dir: str) -> str | None:
    """Each stagemesh server alone at one level: per-stage compute / ring wait / send / other."""
    from stagemesh.bench.profile import profile_endpoint
    from stagemesh.bench.serve import default_num_prompts
    from stagemesh.bench.types import Level

    input_len, output_len, num_prompts = _sizes(args, name)

    def prompts_at(level: int) -> int:
        count = default_num_prompts(Level("concurrency", level), num_prompts, None)
        assert count is not None  # without a duration there is always a count
        return count

    profiles = [profile_endpoint(e.url, e.label, e.model, e.pid, concurrency=level,
                                 num_prompts=prompts_at(level),
                                 input_len=input_len,
                                 output_len=output_len, tokenizer_dir=tokenizer_dir)
                for level in _profile_levels(args) for e in endpoints if e.stagemesh]
    if not profiles:
        return None
    path = out / f"{name}-profile.json"
    path.write_text(json.dumps(profiles, indent=1))
    return str(path)
