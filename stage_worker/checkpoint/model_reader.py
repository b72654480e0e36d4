"""Which reader a model path needs, and its ``ModelSpec``.

Contract:
- ``read_model_spec(path)`` accepts a ``.gguf`` file (``gguf_format``) or a
  directory holding ``config.json`` (MLX / Hugging Face layout,
  ``safetensors_format``) and returns a frozen ``ModelSpec``. It reads headers
  and config files only, never tensor data (the one exception: a Llama 3 GGUF's
  32-float ``rope_freqs`` tensor, from which the rope scaling is recovered).
- ``read_model_spec(path, load_format="dummy")`` (``--load-format dummy``): the
  weights will be random (``dummy_weights``), so a directory needs only its
  ``config.json``; a GGUF lends its architecture, shapes and quantization.
- A path that is neither raises ``ModelFormatError`` saying what to pass.
"""

from __future__ import annotations

import os
from dataclasses import replace

from stage_worker.checkpoint.gguf.format import read_gguf_spec
from stage_worker.checkpoint.model_spec import GGUF_ARCHITECTURES, LOAD_FORMATS, ModelFormatError, ModelSpec
from stage_worker.checkpoint.safetensors_format import read_safetensors_spec


def read_model_spec(path: str, load_format: str = "auto", first_layers: int | None = None) -> ModelSpec:
    """Read a model's spec from a .gguf file or a directory with config.json.

    With ``load_format="dummy"`` the weights need not exist: only the config (or the GGUF's header) is read;
    ``first_layers`` (``--shape-layers``, dummy only) cuts the config to its first decoder layers
    (``stage_worker.checkpoint.first_layers``).
    """
    if load_format not in LOAD_FORMATS:
        raise ModelFormatError(f"--load-format {load_format!r} is not supported; use {' or '.join(LOAD_FORMATS)}.")
    path = os.fspath(path)
    if first_layers is not None and (load_format != "dummy" or not os.path.isdir(path)):
        raise ModelFormatError(f"--shape-layers {first_layers} cuts the config.json of a model directory served "
                               f"with --load-format dummy (random weights); {path} with --load-format {load_format} "
                               f"is not one")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            if load_format == "dummy":
                raise ModelFormatError(
                    f"{path} is a directory without config.json; --load-format dummy needs a Hugging Face "
                    "config.json (the weights are random, so nothing else is read) or a .gguf file."
                )
            raise ModelFormatError(
                f"{path} is a directory without config.json; stagemesh reads a .gguf file "
                "or an MLX / Hugging Face model directory (config.json, *.safetensors, "
                "tokenizer files). Pass one of those."
            )
        return read_safetensors_spec(path, load_format=load_format, first_layers=first_layers)
    if os.path.isfile(path):
        if path.lower().endswith(".gguf"):
            # The header alone gives architecture, shapes and quantization; dummy weights copy them.
            return replace(read_gguf_spec(path), load_format=load_format)
        raise ModelFormatError(
            f"{path} is neither a .gguf file nor a model directory; stagemesh reads "
            f"GGUF files ({', '.join(GGUF_ARCHITECTURES)}) and MLX / Hugging Face model directories."
        )
    raise ModelFormatError(
        f"model {path!r} does not exist; pass a .gguf file, a model directory with "
        "config.json, or a Hugging Face repo id that is already in the local cache."
    )
