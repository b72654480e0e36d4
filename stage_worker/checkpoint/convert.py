"""GGUF -> MLX model directory, loadable by ``mlx_lm.utils.load``.

Contract: ``convert_gguf_to_mlx_dir(gguf_path, out_dir, max_shard_bytes=None)``
writes config.json (Hugging Face style: model_type, architectures, every
ModelArgs field, ``quantization`` and ``quantization_config`` with per-module
overrides such as the default model's 8-bit embedding), the weights exactly as
our GGUF loader produces them (q/k un-permuted, so standard RoPE) as one
model.safetensors or, with ``max_shard_bytes``, as several shards that never
split a layer plus model.safetensors.index.json, the tokenizer files (with the
chat template) and generation_config.json listing the EOS ids. Works one
layer at a time, so memory stays near one shard. Returns ``out_dir``.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

from stage_worker.checkpoint.gguf.format import load_gguf_weights, read_gguf_spec
from stage_worker.checkpoint.model_spec import ModelSpec
from stage_worker.checkpoint.tokenizer import eos_token_ids, load_tokenizer


def _units(spec: ModelSpec) -> Iterator[dict[str, mx.array]]:
    """The model's tensors in order, one unit (embedding, a layer, the head) at a time."""
    yield load_gguf_weights(spec, range(0), with_embedding=True, with_head=False)
    for i in range(spec.num_layers):
        yield load_gguf_weights(spec, range(i, i + 1), with_embedding=False, with_head=False)
    # Norm and (untied) output only: a tied head reuses the embedding written above,
    # so ask as if untied rather than read the embedding twice.
    yield load_gguf_weights(
        dataclasses.replace(spec, tie_word_embeddings=False), range(0), with_embedding=False, with_head=True
    )


def _unit_bytes(unit: dict[str, mx.array]) -> int:
    return sum(v.nbytes for v in unit.values())


def _write_weights(spec: ModelSpec, out: Path, max_shard_bytes: int | None) -> None:
    if max_shard_bytes is None:
        weights: dict[str, mx.array] = {}
        for unit in _units(spec):
            weights.update(unit)
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        return
    # Fill shards greedily with whole units; name them once the count is known.
    temp_files: list[tuple[Path, list[str]]] = []
    shard: dict[str, mx.array] = {}

    def flush() -> None:
        if shard:
            path = out / f"model-{len(temp_files) + 1:05d}.partial.safetensors"
            mx.save_safetensors(str(path), shard, metadata={"format": "mlx"})
            temp_files.append((path, list(shard)))
            shard.clear()

    for unit in _units(spec):
        if shard and _unit_bytes(shard) + _unit_bytes(unit) > max_shard_bytes:
            flush()
        shard.update(unit)
    flush()
    total = len(temp_files)
    index: dict[str, object] = {"metadata": {"total_size": 0}, "weight_map": {}}
    weight_map: dict[str, str] = {}
    for i, (path, keys) in enumerate(temp_files, start=1):
        name = f"model-{i:05d}-of-{total:05d}.safetensors"
        os.replace(path, out / name)
        weight_map.update({k: name for k in keys})
    index["metadata"] = {"total_size": sum((out / n).stat().st_size for n in set(weight_map.values()))}
    index["weight_map"] = dict(sorted(weight_map.items()))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def convert_gguf_to_mlx_dir(gguf_path: str, out_dir: str, max_shard_bytes: int | None = None) -> str:
    """Write an mlx-lm loadable directory with the same weights as the GGUF."""
    spec = read_gguf_spec(gguf_path)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_weights(spec, out, max_shard_bytes)
    tokenizer = load_tokenizer(spec)
    eos = sorted(eos_token_ids(spec, tokenizer))
    config = dict(spec.args)
    if spec.quantization:
        # mlx-lm reads "quantization"; its own converter writes both keys.
        config["quantization"] = dict(spec.quantization)
        config["quantization_config"] = dict(spec.quantization)
    config["bos_token_id"] = tokenizer.bos_token_id
    config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2))
    generation = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": eos if len(eos) > 1 else eos[0]}
    if tokenizer.pad_token_id is not None:
        generation["pad_token_id"] = tokenizer.pad_token_id
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2))
    tokenizer.save_pretrained(str(out))
    return str(out)
