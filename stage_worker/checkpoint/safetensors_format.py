"""MLX / Hugging Face model directories (config.json + *.safetensors).

- ``read_safetensors_spec(path)`` builds a ``ModelSpec`` from config.json and the tensor *names*
  (model.safetensors.index.json when present, else the safetensors headers); no tensor data is read. It takes
  the architectures ``mlx_arch`` serves, unquantized (bf16/f16/f32) or quantized by MLX in any mode and width
  ``model_spec.QUANT_MODES`` lists; anything else raises ``ModelFormatError`` naming the module and what is
  served. The spec's quantization map is explicit: a quantizable module stored without ``.scales`` gets
  ``False``. With ``load_format="dummy"`` it needs config.json only (the weights will be random).
- ``load_safetensors_weights(spec, layers, with_embedding, with_head)`` opens only the shard files that hold
  the slice's tensors (``wanted``), then applies the architecture's own mlx-lm ``Model.sanitize`` to that
  slice (``sanitize_slice``), so a checkpoint in Hugging Face's original layout loads as mlx-lm's layout does.
- ``stored_tensors(file)`` gives each tensor's place (``StoredTensor``) and ``read_part(tensor, keep)`` the part
  keeping given index runs per axis, reading only those bytes (the file mapped, each run copied out): MLX's
  ``mx.load`` reads a tensor whole once any part is evaluated; a tensor-parallel member reads through here.
"""

from __future__ import annotations

import glob
import importlib
import itertools
import json
import os
import re
import struct
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from stage_worker.checkpoint import load_progress
from stage_worker.checkpoint.model_spec import (
    ModelFormatError,
    ModelSpec,
    quant_params,
    served_name_from_path,
)

INDEX_FILE = "model.safetensors.index.json"
_QUANT_KEYS = ("quantization", "quantization_config")


# safetensors dtype -> the numpy dtype its bytes are read as (bfloat16 as its 16-bit pattern, viewed in MLX).
_NUMPY_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "BF16": np.dtype(np.uint16),
    "F64": np.dtype(np.float64), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64), "BOOL": np.dtype(np.bool_),
}


@dataclass(frozen=True)
class StoredTensor:
    """One tensor's place in a safetensors file: its data starts ``offset`` bytes into ``path``."""

    path: str
    offset: int
    dtype: str  # the safetensors dtype name (F32, BF16, U32, ...)
    shape: tuple[int, ...]


def stored_tensors(file: str) -> dict[str, StoredTensor]:
    """Every tensor of ``file`` by name, from its header (no tensor data is read)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        return {name: StoredTensor(file, 8 + n + int(entry["data_offsets"][0]), str(entry["dtype"]),
                                   tuple(int(d) for d in entry["shape"]))
                for name, entry in header.items() if name != "__metadata__"}
    except (OSError, struct.error, ValueError, KeyError, TypeError) as e:
        raise ModelFormatError(f"cannot read the safetensors header of {file}: {e}") from e


def runs_of(indices: Sequence[int]) -> tuple[range, ...]:
    """Sorted distinct ``indices`` as their maximal contiguous runs (pure); ValueError if they are not."""
    if any(b <= a for a, b in itertools.pairwise(indices)):
        raise ValueError("indices must increase")
    runs: list[range] = []
    for index in indices:
        if runs and runs[-1].stop == index:
            runs[-1] = range(runs[-1].start, index + 1)
        else:
            runs.append(range(index, index + 1))
    return tuple(runs)


def part_nbytes(tensor: StoredTensor, keep: Sequence[Sequence[range]]) -> int:
    """The bytes ``read_part(tensor, keep)`` reads (pure)."""
    elements = 1
    for runs in keep:
        elements *= sum(len(r) for r in runs)
    return elements * _NUMPY_DTYPES[tensor.dtype].itemsize


def read_part(tensor: StoredTensor, keep: Sequence[Sequence[range]]) -> mx.array:
    """The part of ``tensor`` keeping, along axis ``a``, the index runs ``keep[a]`` (module docstring)."""
    array = mx.array(read_part_array(tensor, keep))
    return array.view(mx.bfloat16) if tensor.dtype == "BF16" else array


def read_part_array(tensor: StoredTensor, keep: Sequence[Sequence[range]]) -> np.ndarray:
    """``read_part`` as a numpy array (bfloat16 as its 16-bit patterns): also the bytes of a GGUF's blocks."""
    if tensor.dtype not in _NUMPY_DTYPES:
        raise ModelFormatError(f"{tensor.path}: a tensor of dtype {tensor.dtype} cannot be read in parts")
    if len(keep) != len(tensor.shape) or any(r.start < 0 or r.stop > n or not len(r)
                                             for runs, n in zip(keep, tensor.shape) for r in runs):
        raise ValueError(f"runs {keep} do not fit a tensor of shape {tensor.shape}")
    dtype = _NUMPY_DTYPES[tensor.dtype]
    try:
        stored = np.memmap(tensor.path, dtype=dtype, mode="r", offset=tensor.offset, shape=tensor.shape)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"cannot read {tensor.path} at byte {tensor.offset}: {e}") from e
    try:
        # One block per combination of runs (a member's cut has one run per axis but for a segmented cut, such
        # as qwen3_next's convolution: three), joined axis by axis.
        return _joined(stored, [list(runs) for runs in keep], 0)
    finally:
        del stored  # unmapped: the pages read are the page cache's, not this process's


def _joined(stored: np.ndarray, keep: list[list[range]], axis: int) -> np.ndarray:
    """The runs of ``keep[axis:]`` cut from ``stored`` (already cut along the axes before ``axis``), copied."""
    if axis == len(keep):
        return np.array(stored)  # the copy is what reads the mapped bytes
    cut = (slice(None),) * axis
    blocks = [_joined(stored[(*cut, slice(r.start, r.stop))], keep, axis + 1) for r in keep[axis]]
    return blocks[0] if len(blocks) == 1 else np.concatenate(blocks, axis=axis)


def safetensors_header(file: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Each tensor's (safetensors dtype, shape) from a file's header (8-byte length + JSON), no data read."""
    return {name: (tensor.dtype, tensor.shape) for name, tensor in stored_tensors(file).items()}


def _safetensors_keys(file: str) -> list[str]:
    return list(safetensors_header(file))


def weight_map(path: str) -> dict[str, str]:
    """Tensor name -> shard file name, from the index or from the files' headers."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            return dict(json.load(f)["weight_map"])
    # Same glob as mlx-lm's loader.
    files = sorted(glob.glob(os.path.join(path, "model*.safetensors")))
    if not files:
        raise ModelFormatError(
            f"{path} has no model*.safetensors files; an MLX / Hugging Face model directory needs "
            "its weights (model.safetensors or shards with model.safetensors.index.json)."
        )
    return {key: os.path.basename(file) for file in files for key in _safetensors_keys(file)}


# Other quantizers' checkpoints that mlx-lm's loader reads as an MLX mode (mlx_lm.utils.load_model): openai's gpt-oss
# ships its experts as mxfp4 blocks and scales, which the architecture's sanitize lays out as MLX's mxfp4.
_MLX_EQUIVALENTS: dict[str, dict[str, Any]] = {"mxfp4": {"group_size": 32, "bits": 4, "mode": "mxfp4"}}


def _mlx_quantization(config: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    """The config's MLX quantization map, every entry checked against what MLX serves.

    ``quantization`` / ``quantization_config`` as mlx-lm's convert writes it: a group_size, bits and mode at the
    top and per-module overrides, each with its own mode (affine 1-8 bits and mixed recipes, mxfp4, nvfp4,
    mxfp8). An entry MLX cannot serve, a per-expert nvfp4 global scale or quantized activations, and other
    quantizers (AWQ, GPTQ, fp8 ``quant_method``) raise ``ModelFormatError`` naming the module and what is
    served; a ``quant_method`` of ``mxfp4`` (openai's gpt-oss) reads as MLX's mxfp4, as mlx-lm reads it."""
    quant = config.get("quantization")
    if quant is None:
        legacy = config.get("quantization_config")
        if legacy and legacy.get("quant_method") in _MLX_EQUIVALENTS:
            return dict(_MLX_EQUIVALENTS[legacy["quant_method"]])
        if legacy and "quant_method" in legacy:
            raise ModelFormatError(
                f"{path} is quantized with {legacy['quant_method']!r}; stagemesh serves checkpoints quantized by "
                "MLX (mlx_lm.convert -q: affine 1-8 bits, mixed recipes, mxfp4, nvfp4, mxfp8) or unquantized "
                "bf16/f16/f32 ones. Convert it with `mlx_lm.convert --hf-path <model> -q`."
            )
        quant = legacy or None
    if not quant:
        return None
    if config.get("quantize_activations"):
        raise ModelFormatError(f"{path}/config.json quantizes activations (quantize_activations); stagemesh serves "
                               "weight-only quantization. Convert the model without activation quantization.")
    quant = dict(quant)
    quant_params(quant, f"{path}/config.json's quantization")
    for module, value in quant.items():
        if isinstance(value, Mapping):
            where = f"{path}: module {module}"
            if value.get("global_scale"):
                raise ModelFormatError(f"{where} holds a per-expert nvfp4 global scale, which stagemesh does not "
                                       "serve; re-quantize without global scales (mlx_lm.convert -q --q-mode nvfp4).")
            quant_params(value, where)
    return quant


def _quantizable(module: str) -> bool:
    """Linear, Embedding and expert modules (projections, routers, heads); norms are never quantized."""
    return module.endswith(("_proj", "embed_tokens", "lm_head", "output", ".gate", ".router"))


def _explicit_quantization(quant: dict[str, Any] | None, names: Iterable[str]) -> dict[str, Any] | None:
    """Mark quantizable modules stored without scales as False, as mlx-lm would infer."""
    if quant is None:
        return None
    names = set(names)
    for name in sorted(names):
        if name.endswith(".weight"):
            module = name[: -len(".weight")]
            if _quantizable(module) and f"{module}.scales" not in names and module not in quant:
                quant[module] = False
    return quant


def _has_weight_files(path: str) -> bool:
    return os.path.isfile(os.path.join(path, INDEX_FILE)) or bool(glob.glob(os.path.join(path, "model*.safetensors")))


def read_safetensors_spec(path: str, *, load_format: str = "auto", first_layers: int | None = None) -> ModelSpec:
    """The directory's ``ModelSpec`` (see the module docstring). With ``load_format="dummy"`` tensor names are
    still read when there are weight files, so a stored head or unquantized module is honoured. A model whose
    mlx-lm ``Model`` has a head but whose files do not is tied (Gemma 3's sanitize rule)."""
    path = os.path.abspath(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    if first_layers is not None:
        from stage_worker.checkpoint.first_layers import first_layers_config

        config = first_layers_config(config, first_layers)
    from stage_worker.checkpoint.mlx_arch import check_servable, describe, mlx_model_type

    model_type = mlx_model_type(config)
    check_servable(model_type, path)
    assert model_type is not None
    # Random weights need config.json alone; a directory without weights has no names to consult.
    names = weight_map(path) if load_format != "dummy" or _has_weight_files(path) else {}
    tie_default = config.get("tie_word_embeddings")
    args = {k: v for k, v in config.items() if k not in _QUANT_KEYS}
    if tie_default is None and "lm_head.weight" in names:
        # mlx-lm's ModelArgs default to tied; a stored lm_head says otherwise.
        args["tie_word_embeddings"] = False
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    try:
        margs = module.ModelArgs.from_dict(args)
        facts = describe(model_type, args)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise ModelFormatError(f"{path}/config.json is incomplete for mlx-lm's {model_type} model: {e!r}") from e
    # Tied: the model has no head of its own, or its files hold none (mlx-lm's sanitize then ties it).
    # Without files (dummy weights) the config's tie_word_embeddings decides, as the files would.
    stored_head = any(n in names for n in facts.head_names) if names else not config.get("tie_word_embeddings", False)
    tied = not facts.head_names or not stored_head
    quant = _explicit_quantization(_mlx_quantization(config, path), names)
    return ModelSpec(
        path=path,
        format="mlx",
        model_type=model_type,
        args=args,
        num_layers=int(margs.num_hidden_layers),
        hidden_size=int(margs.hidden_size),
        vocab_size=int(margs.vocab_size),
        tie_word_embeddings=tied,
        quantization=quant,
        default_served_name=served_name_from_path(path),
        details={"weight_map": names},
        load_format=load_format,
    )


def wanted(name: str, layers: range, with_embedding: bool, with_head: bool, tied: bool) -> bool:
    """Whether a stage holding ``layers`` keeps tensor ``name`` (after sanitize)."""
    if "rotary_emb.inv_freq" in name:
        return False  # mlx-lm recomputes rotary frequencies
    if name.startswith("model.layers."):
        return int(name.split(".", 3)[2]) in layers
    if name.startswith("model.embed_tokens."):
        return with_embedding or (with_head and tied)
    if not name.startswith("model."):
        return with_head and not tied  # the head (lm_head, output); sanitize drops a tied one
    return with_head  # the final norm


def load_safetensors_weights(
    spec: ModelSpec, layers: range, with_embedding: bool, with_head: bool, evaluate: bool = True,
    sources: dict[str, StoredTensor] | None = None,
) -> dict[str, mx.array]:
    """Read only the shards holding the slice's tensors; return mlx-lm names. ``mx.load`` is lazy, so only
    the kept arrays are read (``wanted``: rotary ``inv_freq`` and a stored head that the embeddings tie are left
    out). Without ``evaluate`` nothing is read yet: a tensor-parallel member reads its part of each tensor
    instead (``share_reads``). ``sources``, if given, is filled with the ``StoredTensor`` behind each returned
    array that is the file's tensor as stored (under the same name, untouched by sanitize)."""
    names = spec.details.get("weight_map") or weight_map(spec.path)
    by_file: dict[str, list[str]] = defaultdict(list)
    for name, file in names.items():
        if wanted(name, layers, with_embedding, with_head, spec.tie_word_embeddings):
            by_file[file].append(name)
    weights: dict[str, mx.array] = {}
    shards: list[list[str]] = []
    for file, keys in sorted(by_file.items()):
        full = os.path.join(spec.path, file)
        if not os.path.isfile(full):
            raise ModelFormatError(f"shard {full} holding {keys[0]} is missing; download the model's shards again.")
        try:
            # lazy: only the arrays we evaluate are read. mlx annotates mx.load's result as any of
            # its formats' results; a .safetensors file without return_metadata gives the dict.
            arrays: dict[str, mx.array] = mx.load(full)  # type: ignore[assignment]
        except (RuntimeError, ValueError) as e:
            raise ModelFormatError(f"cannot read {full}: {e}") from e
        for key in keys:
            if key not in arrays:
                raise ModelFormatError(f"{full} lacks {key}, which {INDEX_FILE} places there.")
            weights[key] = arrays[key]
        del arrays
        shards.append(keys)
    load_progress.expect(sum(weights[k].nbytes for k in weights))
    if not evaluate:
        sanitized = sanitize_slice(spec, weights, layers)
        if sources is not None:
            untouched = [name for name, array in sanitized.items() if weights.get(name) is array]
            for file in {names[name] for name in untouched}:
                stored = stored_tensors(os.path.join(spec.path, file))
                sources.update({name: stored[name] for name in untouched if names[name] == file})
        return sanitized
    for keys in shards:  # one shard after the other, a few hundred MB per evaluation, so progress moves
        for chunk in _chunks(keys, weights, _READ_CHUNK_BYTES):
            mx.eval([weights[k] for k in chunk])
            load_progress.read(sum(weights[k].nbytes for k in chunk))
    return sanitize_slice(spec, weights, layers)


_READ_CHUNK_BYTES = 256 << 20


def _chunks(keys: list[str], arrays: Mapping[str, mx.array], limit: int) -> Iterable[list[str]]:
    """``keys`` in order, grouped so each group's arrays hold about ``limit`` bytes (at least one key)."""
    group: list[str] = []
    size = 0
    for key in keys:
        group.append(key)
        size += arrays[key].nbytes
        if size >= limit:
            yield group
            group, size = [], 0
    if group:
        yield group


def sanitize_slice(spec: ModelSpec, weights: dict[str, mx.array], layers: range) -> dict[str, mx.array]:
    """mlx-lm's own ``Model.sanitize`` for the architecture, on one stage's tensors (global names in and out).

    It turns a checkpoint in Hugging Face's original layout into mlx-lm's (one tensor per expert stacked
    into one per projection, gpt-oss's joined gate and up projections split, ...) and leaves mlx-lm's
    layout as it is. Several sanitizers tell the layouts apart by looking at layer 0, so the slice is
    renumbered to start at layer 0 for the call (they treat every layer alike otherwise); and it runs on a
    scratch model, built lazily, since some change the model they are called on (Gemma 3 drops its head)."""
    arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    if not hasattr(arch.Model, "sanitize"):
        return weights
    scratch = arch.Model(arch.ModelArgs.from_dict(dict(spec.args)))
    renumbered = {_shift_layer(name, -layers.start): array for name, array in weights.items()}
    try:
        sanitized = scratch.sanitize(renumbered)
    except KeyError as exc:  # stacking a layer's experts, one was not there
        missing = _shift_layer(str(exc.args[0]), layers.start)
        raise ModelFormatError(f"{spec.path} lacks {missing}, which mlx-lm's {spec.model_type} model needs for its "
                               f"config.json (its sanitize assembles the layer's tensors from it)") from exc
    except ValueError as exc:  # stacking tensors of different shapes
        odd = _odd_shapes(weights)
        raise ModelFormatError(f"{spec.path}: mlx-lm's {spec.model_type} sanitize cannot assemble the checkpoint's "
                               f"tensors ({exc})" + (f": {', '.join(odd[:5])}" if odd else "")) from exc
    return {_shift_layer(name, layers.start): array for name, array in sanitized.items()}


_EXPERT_INDEX = re.compile(r"\.experts\.\d+\.")


def _odd_shapes(weights: Mapping[str, mx.array]) -> list[str]:
    """Per-expert tensors whose shape differs from most of their layer's other experts' (to be stacked)."""
    groups: dict[str, list[str]] = defaultdict(list)
    for name in weights:
        if _EXPERT_INDEX.search(name):
            groups[_EXPERT_INDEX.sub(".experts.*.", name)].append(name)
    odd = []
    for names in groups.values():
        shapes = [tuple(weights[n].shape) for n in names]
        common = max(set(shapes), key=shapes.count)
        odd += [f"{n} is {shape}, its layer's other experts {common}" for n, shape in zip(names, shapes)
                if shape != common]
    return odd


def _shift_layer(name: str, by: int) -> str:
    """``model.layers.{i}.rest`` -> ``model.layers.{i + by}.rest``; other names as they are."""
    if not by or not name.startswith("model.layers."):
        return name
    index, rest = name[len("model.layers."):].split(".", 1)
    return f"model.layers.{int(index) + by}.{rest}"
