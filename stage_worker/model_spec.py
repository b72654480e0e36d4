"""What a model is, read from its metadata alone: the frozen ``ModelSpec`` every format reader returns.

Contract:
- ``stage_worker.model_reader.read_model_spec(path)`` reads one from a ``.gguf``
  file (``gguf_format``) or a directory holding ``config.json`` (MLX / Hugging
  Face layout, ``safetensors_format``); the readers share this module's types
  and rules (supported architectures, quantization checks, the served name).
- ``ModelSpec.args`` is a plain dict that ``mlx_lm.models.<model_type>.ModelArgs
  .from_dict`` accepts; ``ModelSpec.quantization`` is in mlx-lm's config style
  (top-level ``group_size``/``bits``, per-module overrides, ``False`` for a
  module kept unquantized).
- Anything we cannot serve (architecture: ``mlx_arch`` says which and why,
  tensor type, quantization mode, a missing file) raises ``ModelFormatError`` (a ``ValueError``) whose message
  says what is supported and what the user should change.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from stagemesh.core.errors import UserError

# GGUF files of these llama.cpp architectures are read (gguf_format; one table each in gguf_architectures);
# safetensors directories of every architecture stage_worker.mlx_arch serves.
GGUF_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen3moe", "gemma3")
# Bits that mx.quantize's affine mode accepts.
SUPPORTED_AFFINE_BITS: tuple[int, ...] = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
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
    """Architecture, size and quantization of a model, without its weights."""

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

    def quantization_for(self, module_path: str) -> tuple[int, int] | None:
        """(group_size, bits) for a quantizable module (Linear/Embedding), or None.

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


def quantization_for(
    quantization: Mapping[str, Any] | None, module_path: str
) -> tuple[int, int] | None:
    """Resolve one module's (group_size, bits) from an mlx-lm quantization map."""
    if not quantization:
        return None
    override = quantization.get(module_path)
    if override is False:
        return None
    if isinstance(override, Mapping):
        return int(override["group_size"]), int(override["bits"])
    return int(quantization["group_size"]), int(quantization["bits"])


def check_affine(group_size: int, bits: int, where: str) -> None:
    """Raise unless mx.quantize's affine mode can represent (group_size, bits)."""
    if bits not in SUPPORTED_AFFINE_BITS or group_size not in SUPPORTED_GROUP_SIZES:
        raise ModelFormatError(
            f"{where} uses {bits}-bit quantization with group size {group_size}; "
            f"stagemesh serves MLX affine quantization with bits in "
            f"{list(SUPPORTED_AFFINE_BITS)} and group size in {list(SUPPORTED_GROUP_SIZES)}. "
            "Re-quantize with `mlx_lm.convert -q --q-bits 4` (or 8), or use an unquantized model."
        )


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
