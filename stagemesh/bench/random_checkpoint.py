"""A real-sized model with random weights, written as an mlx-lm checkpoint both servers can load.

``stagemesh bench compare --shape llama-3.2-1b`` compares stagemesh with ``mlx_lm.server`` on a model of a real
size without downloading one. ``write_shape_checkpoint`` writes the ``--shape`` (a shipped ``config.json`` under
``SHAPES_DIR``, ``stagemesh/bench/model_configs/``; ``shape_names`` lists them), ``write_random_checkpoint`` any
config: weights drawn by mlx-lm's own model class in the shape's dtype, and a tokenizer extended to the shape's
vocabulary. Both servers then read the same files, so neither gets a lighter model than the other
(``stagemesh serve --load-format dummy`` draws random weights inside each stage instead, without files).
``shape_config`` cuts a shape to its first ``--shape-layers`` decoder layers, so part of a model too big for
the machine can run; ``--shape-quantization NAME`` (``SHAPE_QUANTIZATIONS``) quantizes the random weights as
``mlx_lm.convert -q`` would, into a genuine mlx-lm quantized checkpoint. ``check_shape_flags`` checks a kind's
MODEL and shape flags together.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES_DIR = Path(__file__).resolve().parent / "model_configs"


@dataclass(frozen=True)
class ShapeQuantization:
    """One of mlx_lm.convert's quantizations: ``--q-mode``, ``--q-bits`` and ``--q-group-size`` (None: the mode's
    default), and a mixed ``--quant-predicate`` recipe (affine, its low and high bits by layer)."""

    mode: str
    bits: int | None = None
    group_size: int | None = None
    recipe: str | None = None


# --shape-quantization NAME: affine at each width mlx-lm writes (groups of 64, its default), the fp modes at their
# only width, and mlx_lm.convert's mixed recipes (mlx_lm.convert.QUANT_RECIPES).
SHAPE_QUANTIZATIONS: dict[str, ShapeQuantization] = {
    **{f"affine{bits}": ShapeQuantization("affine", bits, 64) for bits in (2, 3, 4, 5, 6, 8)},
    "mxfp4": ShapeQuantization("mxfp4"), "nvfp4": ShapeQuantization("nvfp4"), "mxfp8": ShapeQuantization("mxfp8"),
    **{recipe: ShapeQuantization("affine", group_size=64, recipe=recipe)
       for recipe in ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")},
}


def shape_names() -> list[str]:
    """The shapes shipped with the benchmarks, by name (``llama-3.1-8b``, ...)."""
    if not SHAPES_DIR.is_dir():
        return []
    return sorted(p.name for p in SHAPES_DIR.iterdir() if (p / "config.json").is_file())


def add_load_format_argument(parser: argparse._ActionsContainer) -> None:
    """``--load-format``, as ``stagemesh serve`` and ``stagemesh bench parity`` take it: ``dummy`` names a shape
    of ``shape_names`` or a config. Here, beside the shapes, so a bench kind builds it without importing
    ``stagemesh.serve`` (which pulls in grpc)."""
    parser.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                        help="auto reads the model's weights; dummy gives every stage random weights for its slice, "
                             "to benchmark a model's size without its weights: MODEL is then a directory with a "
                             "config.json, a .gguf file, or one of the shapes " + ", ".join(shape_names()))


def shape_config(name: str, layers: int | None = None) -> dict:
    """The shape's config.json; with ``layers``, cut to its first ``layers`` decoder layers, its layer pattern
    kept (``stage_worker.checkpoint.first_layers``)."""
    path = SHAPES_DIR / name / "config.json"
    if not path.is_file():
        from stagemesh_core.errors import UserError

        raise UserError(f"--shape {name!r} is not one of the shipped shapes: {', '.join(shape_names())}")
    config = json.loads(path.read_text())
    if layers is None:
        return config
    from stage_worker.checkpoint.first_layers import first_layers_config

    return first_layers_config(config, layers)


def check_shape_flags(args: argparse.Namespace) -> None:
    """A bench kind's MODEL, ``--shape`` and ``--shape-layers`` together make sense, else ``UserError``."""
    from stagemesh_core.errors import UserError

    if args.shape and args.model:
        raise UserError("give MODEL or --shape, not both")
    if args.shape_layers is not None and not args.shape:
        raise UserError("--shape-layers cuts a --shape model; give --shape NAME too")
    if args.shape_quantization is not None and not args.shape:
        raise UserError("--shape-quantization quantizes a --shape model; give --shape NAME too")
    if args.shape:
        shape_config(args.shape, args.shape_layers)  # an unknown shape or a layer count it cannot take


def write_shape_checkpoint(args: argparse.Namespace, root: Path) -> str:
    """The ``--shape`` checkpoint (its first ``--shape-layers`` layers when given, quantized as
    ``--shape-quantization`` says) written under ``root``."""
    name = args.shape + (f"-{args.shape_layers}-layers" if args.shape_layers is not None else "")
    name += f"-{args.shape_quantization}" if args.shape_quantization else ""
    return str(write_random_checkpoint(shape_config(args.shape, args.shape_layers), root / name, args.shape_dtype,
                                       tokenizer_dir=args.shape_tokenizer, quantization=args.shape_quantization))


def shape_description(args: argparse.Namespace) -> str:
    """What the ``--shape`` checkpoint holds, for a progress line: its dtype, and its quantization if any."""
    return f"random {args.shape_dtype}" + (f", {args.shape_quantization}" if args.shape_quantization else "")


SHARD_BYTES = 2 * 1024**3  # a shard's size: the most weights in memory at once while writing


def write_random_checkpoint(config: dict, out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0,
                            tokenizer_dir: str | None = None, shard_bytes: int = SHARD_BYTES,
                            quantization: str | None = None) -> Path:
    """Write ``config`` with random weights (``dtype``) and an extended tokenizer to ``out_dir``; with
    ``quantization`` (a ``SHAPE_QUANTIZATIONS`` name) the weights quantized as mlx_lm.convert would.

    Weights up to ``shard_bytes`` go to ``model.safetensors``; more are drawn and written one shard at a
    time (``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json``, Hugging Face's
    layout), so a checkpoint larger than memory can be written. The tokenizer is ``tokenizer_dir``'s (a
    Hugging Face tokenizer directory), else the embedded default model's."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = {**config, "torch_dtype": dtype}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    if quantization is not None:
        model, config = _quantize(model, config, quantization)
    # Nothing is drawn yet: each shard's weights are drawn (and freed) when it is written.
    weights: dict[str, mx.array] = dict(tree_flatten(model.parameters()))
    del model
    shards = _shards({name: array.nbytes for name, array in weights.items()}, shard_bytes)
    if len(shards) == 1:
        mx.eval(weights)
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    else:
        index: dict[str, str] = {}
        total = sum(array.nbytes for array in weights.values())
        for number, names in enumerate(shards, 1):
            file = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
            shard = {name: weights.pop(name) for name in names}
            mx.eval(shard)
            mx.save_safetensors(str(out / file), shard, metadata={"format": "mlx"})
            index.update(dict.fromkeys(names, file))
            del shard
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=2))
    del weights
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(out, int(config["vocab_size"]), tokenizer_dir)
    return out


def _quantize(model: Any, config: dict, name: str) -> tuple[Any, dict]:
    """mlx-lm's own quantization of ``model`` (``quantize_model``; for a mixed recipe with ``mlx_lm.convert``'s
    predicate), lazily: each weight is drawn and quantized as its shard is written; and the config it writes
    for it, the ``quantization`` block mlx-lm's loader reads, so ``mlx_lm.server`` and stagemesh both load it."""
    import contextlib
    import sys

    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import quantize_model

    if name not in SHAPE_QUANTIZATIONS:
        from stagemesh_core.errors import UserError

        raise UserError(f"--shape-quantization {name!r}: choose from {', '.join(SHAPE_QUANTIZATIONS)}")
    chosen = SHAPE_QUANTIZATIONS[name]
    # Any: mlx-lm annotates the recipe's predicate with a third argument that quantize_model never passes.
    predicate: Any = (mixed_quant_predicate_builder(chosen.recipe, model, chosen.group_size or 64)
                      if chosen.recipe else None)
    with contextlib.redirect_stdout(sys.stderr):  # mlx-lm prints the bits per weight; stdout may carry a report
        return quantize_model(model, config, chosen.group_size, chosen.bits, mode=chosen.mode,
                              quant_predicate=predicate)


def _shards(sizes: dict[str, int], shard_bytes: int) -> list[list[str]]:
    """Tensor names in order, cut into runs of at most ``shard_bytes`` (a larger tensor alone in its own)."""
    shards: list[list[str]] = [[]]
    held = 0
    for name, size in sizes.items():
        if shards[-1] and held + size > shard_bytes:
            shards.append([])
            held = 0
        shards[-1].append(name)
        held += size
    return shards


def _write_tokenizer(out: Path, vocab_size: int, tokenizer_dir: str | None) -> None:
    """The embedded default model's tokenizer (or ``tokenizer_dir``'s) extended with reserved tokens up to
    ``vocab_size``, so every id either server samples decodes (the extra ones as ``<|reserved_N|>`` text,
    which a benchmark counting streamed text sees)."""
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        from stage_worker.checkpoint.tokenizer import default_model_tokenizer

        tokenizer = default_model_tokenizer()
    missing = vocab_size - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tokenizer.save_pretrained(str(out))
