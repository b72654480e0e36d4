"""What a model is, read from its metadata alone: the frozen ``ModelSpec`` every format reader returns.

- ``stage_worker.checkpoint.model_reader.read_model_spec(path)`` reads one from a ``.gguf`` file (``gguf_format``) or a
  directory holding ``config.json`` (MLX / Hugging Face layout, ``safetensors_format``); the readers share
  this module's types and rules (supported architectures, quantization checks, the served name).
- ``ModelSpec.args`` is a plain dict that ``mlx_lm.models.<model_type>.ModelArgs.from_dict`` accepts;
  ``ModelSpec.quantization`` is in mlx-lm's config style.
- One module's quantization is resolved in one place: ``quantization_for`` gives a frozen ``QuantParams``, or
  None for a dense module; ``check_quantization`` accepts exactly what ``mx.quantize`` serves (``QUANT_MODES``).
- Anything we cannot serve (architecture: ``mlx_arch`` says which and why, tensor type, quantization mode, a
  missing file) raises ``ModelFormatError`` (a ``ValueError``) whose message says what is supported and what
  the user should change.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stagemesh_core.errors import UserError

# GGUF files of these llama.cpp architectures are read (gguf_format; one table each in gguf_architectures);
# safetensors directories of every architecture stage_worker.checkpoint.mlx_arch serves.
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe", "gemma3")
# mx.quantize's modes: (bits, group sizes) each serves. The fp modes allow one pair each (their scale format
# fixes it) and store uint8 scales and no biases.
QUANT_MODES: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {
    "affine": ((1, 2, 3, 4, 5, 6, 8), (32, 64, 128)),
    "mxfp4": ((4,), (32,)),
    "nvfp4": ((4,), (16,)),
    "mxfp8": ((8,), (32,)),
}
# The (group_size, bits) a mode takes where the config leaves them null (MLX's and mlx-lm's defaults).
MODE_DEFAULTS: dict[str, tuple[int, int]] = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
# --load-format: auto reads the weights from the model's files; dummy generates random ones of the same shapes.
LOAD_FORMATS: tuple[str, ...] = ("auto", "dummy")


class ModelFormatError(UserError):
    """A model we cannot serve; the message says what to change."""


def tensor_mismatch(missing: list[str], wrong_shapes: list[str], extra: list[str], shown: int = 5) -> str:
    """What a checkpoint's tensors lack, hold in other shapes and hold beyond a model, for an error message
    (the first ``shown`` of each, and how many more); empty when nothing is amiss."""
    def some(names: list[str]) -> str:
        return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")

    return "; ".join(([f"missing {some(missing)}"] if missing else []) + ([some(wrong_shapes)] if wrong_shapes else [])
                     + ([f"not in the model: {some(extra)}"] if extra else []))


@dataclass(frozen=True)
class ModelSpec:
    """Architecture, size and quantization of a model, without its weights.

    ``quantization`` is in mlx-lm's config style: top-level ``group_size``/``bits``/``mode``, per-module
    overrides that may carry their own ``mode``, ``False`` for a module kept unquantized."""

    path: str
    format: Literal["gguf", "mlx"]
    model_type: str
    args: Mapping[str, Any]
    num_layers: int
    hidden_size: int
    vocab_size: int
    tie_word_embeddings: bool
    quantization: Mapping[str, Any] | None
    default_served_name: str
    # Extra facts the format layer found useful (e.g. GGUF tensor types); not a contract.
    details: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # "dummy": the weights are generated, not read (``format`` still says where the shapes came from).
    load_format: str = "auto"

    def quantization_for(self, module_path: str) -> QuantParams | None:
        """How a quantizable module (Linear, Embedding, expert stack) is quantized, or None if it is not.

        ``module_path`` is mlx-lm's module name, e.g. ``model.layers.3.mlp.up_proj``.
        Norms are never quantized; do not ask for them.
        """
        return quantization_for(self.quantization, module_path)

    @property
    def quantized(self) -> bool:
        return bool(self.quantization)

    @property
    def random_weights(self) -> bool:
        return self.load_format == "dummy"


@dataclass(frozen=True)
class QuantParams:
    """How one module's weight is quantized: ``mx.quantize``'s group_size, bits and mode."""

    group_size: int
    bits: int
    mode: str = "affine"

    @property
    def has_biases(self) -> bool:
        """affine stores a scale and a bias per group in the weights' dtype; the fp modes a uint8 scale only."""
        return self.mode == "affine"

    def as_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``mx.quantize`` and of a module's ``to_quantized``."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def describe(self) -> str:
        return f"{self.mode} {self.bits}-bit, group size {self.group_size}"


def quant_params(entry: Mapping[str, Any], where: str) -> QuantParams:
    """One quantization entry of an mlx-lm config (the top level or a module's override) as ``QuantParams``,
    a null group size or bit width taking the mode's default as MLX does; ``ModelFormatError`` naming
    ``where`` for what MLX cannot serve (``check_quantization``)."""
    mode = str(entry.get("mode") or "affine")
    if mode not in QUANT_MODES:
        raise ModelFormatError(f"{where} uses quantization mode {mode!r}; {_SERVED_MODES}. {_REQUANTIZE}")
    default_group, default_bits = MODE_DEFAULTS[mode]
    group_size, bits = entry.get("group_size"), entry.get("bits")
    try:
        params = QuantParams(default_group if group_size is None else int(group_size),
                             default_bits if bits is None else int(bits), mode)
    except (TypeError, ValueError) as e:
        raise ModelFormatError(f"{where} has a quantization entry MLX cannot read ({dict(entry)}): {e}") from e
    check_quantization(params, where)
    return params


def quantization_for(quantization: Mapping[str, Any] | None, module_path: str) -> QuantParams | None:
    """Resolve one module's ``QuantParams`` from an mlx-lm quantization map, as mlx-lm's loader does: the
    module's own entry (``False``: kept dense; a mapping: its own parameters), else the top level.

    For a quantized module without an entry, mlx-lm's loader reads the parameters off the stored tensors
    (``mlx_lm.utils.infer_quant_config``) instead; the map alone serves here because the planner and dummy
    weights have no tensors. mlx-lm's ``quantize_model`` writes an entry for every module quantized other
    than the top level says, so the two agree on its checkpoints; ``checkpoint_check`` names a module
    whose stored codes or scales disagree with the map."""
    if not quantization:
        return None
    override = quantization.get(module_path)
    if override is False:
        return None
    if isinstance(override, Mapping):
        return quant_params(override, f"module {module_path}")
    return quant_params(quantization, "the quantization config")


def check_quantization(params: QuantParams, where: str) -> None:
    """Raise unless ``mx.quantize`` serves ``params`` (``QUANT_MODES``), naming ``where`` and what is served."""
    bits, group_sizes = QUANT_MODES.get(params.mode, ((), ()))
    if params.bits not in bits or params.group_size not in group_sizes:
        raise ModelFormatError(f"{where} uses {params.describe()} quantization; {_SERVED_MODES}. {_REQUANTIZE}")


_SERVED_MODES = "MLX serves " + "; ".join(
    f"{mode} with {'/'.join(map(str, bits))} bits in groups of {'/'.join(map(str, groups))}"
    for mode, (bits, groups) in QUANT_MODES.items())
_REQUANTIZE = ("Re-quantize with `mlx_lm.convert -q --q-mode affine --q-bits 4` (or --q-mode mxfp4, nvfp4, mxfp8), "
               "or use an unquantized model.")


_GGUF_QUANT_SUFFIX = re.compile(r"[.-](?:I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)
_HF_SNAPSHOT = re.compile(r"models--([^/]+)--([^/]+)/snapshots/[^/]+$")


def served_name_from_path(path: str) -> str:
    """A readable model name: "org/name" for a Hugging Face cache snapshot, the
    directory name, or the GGUF file name without .gguf and its quant suffix
    (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct)."""
    norm = os.path.normpath(os.path.abspath(path))
    if m := _HF_SNAPSHOT.search(norm.replace(os.sep, "/")):
        return f"{m.group(1)}/{m.group(2)}"
    base = os.path.basename(norm)
    if base.lower().endswith(".gguf"):
        stem = base[: -len(".gguf")]
        return _GGUF_QUANT_SUFFIX.sub("", stem) or stem
    return base
