"""A checkpoint's tensors against its config.json, from the safetensors headers alone (no tensor data read).

Contract: ``check_checkpoint(spec)`` raises ``ModelFormatError`` naming the tensors that mlx-lm's model
for ``spec``'s config needs and the files lack, holds in another shape (with the file holding it), or
holds beyond what the model has, judged as the stages will load them: every tensor a stage keeps
(``safetensors_format.wanted``), after the architecture's own ``sanitize`` (a Hugging Face layout's
experts stacked: an expert missing there is named as the tensor the sanitizer could not find),
quantized where the files hold scales, as config.json's quantization says (scales of another kind
than that mode's, uint8 for mxfp4/nvfp4/mxfp8 and floating for affine, are named too). ``stagemesh
serve`` and ``stagemesh plan`` call it before any stage starts, so such a checkpoint exits 2 with the
tensor's name rather than failing in a stage (which checks its own slice again, ``stage_model``). GGUF
files and ``--load-format dummy`` pass unchecked: their tensors are the format reader's or generated.

The sanitizer runs on placeholder arrays of the headers' shapes and dtypes (``mx.zeros``, never
evaluated), so stacking experts costs nothing but shape arithmetic.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from stage_worker.checkpoint.mlx_arch import describe
from stage_worker.checkpoint.model_spec import ModelFormatError, ModelSpec, tensor_mismatch
from stage_worker.checkpoint.safetensors_format import safetensors_header, sanitize_slice, wanted, weight_map

# safetensors dtypes as the placeholders' MLX dtypes (fp8 arrives as bytes; mlx-lm's sanitizers convert it).
_DTYPES = {"F64": mx.float32, "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "I64": mx.int64,
           "U64": mx.uint64, "I32": mx.int32, "U32": mx.uint32, "I16": mx.int16, "U16": mx.uint16, "I8": mx.int8,
           "U8": mx.uint8, "BOOL": mx.bool_, "F8_E4M3": mx.uint8, "F8_E5M2": mx.uint8}


def check_checkpoint(spec: ModelSpec) -> None:
    """Raise ``ModelFormatError`` unless the files hold what mlx-lm's model for the config needs (see above)."""
    if spec.format != "mlx" or spec.random_weights:
        return
    names = spec.details.get("weight_map") or weight_map(spec.path)
    every_layer = range(spec.num_layers)
    tensors: dict[str, tuple[str, tuple[int, ...]]] = {}
    where: dict[str, str] = {}
    for file in sorted(set(names.values())):
        for name, (dtype, shape) in safetensors_header(os.path.join(spec.path, file)).items():
            if names.get(name) == file and wanted(name, every_layer, True, True, spec.tie_word_embeddings):
                tensors[name], where[name] = (dtype, shape), file
    placeholders = {name: mx.zeros(shape, _DTYPES.get(dtype, mx.float32)) for name, (dtype, shape) in tensors.items()}
    given = sanitize_slice(spec, placeholders, every_layer)  # names an expert it could not find or stack
    expected = _expected_parameters(spec, given)
    missing = [n for n in expected if n not in given]
    shapes = [f"{n} is {tuple(given[n].shape)} in {where.get(n, 'the files (as sanitize assembles it)')}, "
              f"{tuple(a.shape)} by the config" for n, a in expected.items()
              if n in given and given[n].shape != a.shape]
    # The scales' kind first: a mislabelled mode shows there, where its shapes may agree.
    shapes = mismatched_scales(expected, given, lambda name: f"{name} in {where.get(name, 'the files')}") + shapes
    problems = tensor_mismatch(missing, shapes, [n for n in given if n not in expected])
    if problems:
        raise ModelFormatError(f"{spec.path} does not match mlx-lm's {spec.model_type} model for its config.json: "
                               f"{problems}")


def _expected_parameters(spec: ModelSpec, given: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-lm's model for the config (built lazily), quantized where the files hold scales, as a stage does."""
    arch = importlib.import_module(f"mlx_lm.models.{spec.model_type}")
    model = arch.Model(arch.ModelArgs.from_dict(dict(spec.args)))

    def quantized(path: str, module: nn.Module) -> dict[str, int] | bool:
        if f"{path}.scales" not in given:
            return False
        params = spec.quantization_for(path)
        if params is None:
            raise ModelFormatError(f"{spec.path}: {path} arrives quantized but config.json gives no bits")
        return params.as_kwargs()

    nn.quantize(model, class_predicate=quantized)
    flat: list[tuple[str, mx.array]] = tree_flatten(model.parameters())  # type: ignore[assignment]
    head = describe(spec.model_type, spec.args).head_names if spec.tie_word_embeddings else ()
    return {name: array for name, array in flat if name not in head}


def mismatched_scales(expected: Mapping[str, mx.array], given: Mapping[str, mx.array],
                      name: Callable[[str], str]) -> list[str]:
    """Quantization scales whose kind differs between the model as the config quantizes it and the files: an fp
    mode (mxfp4, nvfp4, mxfp8) keeps uint8 scales, affine floating ones, and the codes of affine 4-bit in groups
    of 32 have mxfp4's shapes, so the shapes alone cannot tell a mislabelled module."""
    def kind(array: mx.array) -> str:
        return "uint8 (an mxfp4, nvfp4 or mxfp8 module)" if array.dtype == mx.uint8 else "floating (an affine module)"

    return [f"{name(n)}: its scales are {kind(given[n])} in the files, {kind(a)} by the config"
            for n, a in expected.items() if n.endswith(".scales") and n in given and kind(given[n]) != kind(a)]
