"""A real-sized model with random weights, written as an mlx-lm checkpoint both servers can load.

``stagemesh bench compare --shape llama-3.2-1b`` compares stagemesh with
``mlx_lm.server`` on a model of a real size without downloading one: the
shape's ``config.json`` (``stagemesh/bench/model_configs/``), weights drawn
by mlx-lm's own model class in the shape's dtype, and the embedded default
model's tokenizer (or ``tokenizer_dir``'s) extended with reserved tokens up to
the shape's vocabulary, so every id either server samples decodes (the extra
ones as ``<|reserved_N|>`` text, which a benchmark counting streamed text
sees). Both servers then read the same files, so neither gets a lighter model
than the other. ``stagemesh serve --load-format dummy`` draws random weights
inside each stage instead, without files.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPES_DIR = Path(__file__).resolve().parent / "model_configs"


def shape_names() -> list[str]:
    """The shapes shipped with the benchmarks, by name (``llama-3.1-8b``, ...)."""
    if not SHAPES_DIR.is_dir():
        return []
    return sorted(p.name for p in SHAPES_DIR.iterdir() if (p / "config.json").is_file())


def shape_config(name: str) -> dict:
    path = SHAPES_DIR / name / "config.json"
    if not path.is_file():
        from stagemesh.core.errors import UserError

        raise UserError(f"--shape {name!r} is not one of the shipped shapes: {', '.join(shape_names())}")
    return json.loads(path.read_text())


def write_random_checkpoint(config: dict, out_dir: str | Path, dtype: str = "bfloat16", seed: int = 0,
                            tokenizer_dir: str | None = None) -> Path:
    """Write ``config`` with random weights (``dtype``) and an extended tokenizer to ``out_dir``.

    The tokenizer is ``tokenizer_dir``'s (a Hugging Face tokenizer directory), else the embedded
    default model's."""
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
    weights = dict(tree_flatten(model.parameters()))
    mx.eval(weights)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    del weights, model
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _write_tokenizer(out, int(config["vocab_size"]), tokenizer_dir)
    return out


def _write_tokenizer(out: Path, vocab_size: int, tokenizer_dir: str | None) -> None:
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        from stage_worker.tokenizer import default_model_tokenizer

        tokenizer = default_model_tokenizer()
    missing = vocab_size - len(tokenizer)
    if missing > 0:
        tokenizer.add_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    tokenizer.save_pretrained(str(out))
