"""``stagemesh convert GGUF OUT_DIR``: write an mlx-lm model directory from a GGUF file.

The directory holds the same weights our GGUF loader serves (quantized blocks
kept as MLX affine arrays, q/k rows un-permuted), config.json with per-module
quantization, tokenizer files with the chat template, and generation_config.json;
``mlx_lm`` loads it, so it is also the reference for benchmarks. A progress bar on
stderr follows the bytes the GGUF reader has read and converted.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stage_worker.checkpoint.load_progress import LoadCounts, WeightProgress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("gguf", nargs="?", default=None, help="GGUF file (default: the embedded default model)")
    parser.add_argument("out_dir", help="directory to write")
    parser.add_argument("--max-shard-mb", type=float, default=None,
                        help="split weights into shards of at most this many MB (never splitting a layer)")


@contextlib.contextmanager
def _progress_bar() -> Iterator[WeightProgress]:
    """A rich bar on stderr, fed by the reader's byte counts (``stage_worker.checkpoint.load_progress``)."""
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    from stage_worker.checkpoint.load_progress import WeightProgress

    columns = (TextColumn("converting"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True)) as bar:
        task = bar.add_task("converting", total=None)

        def update(counts: LoadCounts) -> None:
            bar.update(task, completed=counts.done_bytes, total=counts.total_bytes or None)

        yield WeightProgress(on_change=update)


def run(args: argparse.Namespace) -> int:
    from stage_worker.checkpoint.convert import convert_gguf_to_mlx_dir
    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.load_progress import reporting

    source = resolve_model_path(args.gguf)
    max_bytes = int(args.max_shard_mb * 1e6) if args.max_shard_mb else None
    with _progress_bar() as progress, reporting(progress):
        out = convert_gguf_to_mlx_dir(source, args.out_dir, max_shard_bytes=max_bytes)
    print(f"wrote {out} from {source}")
    return 0
