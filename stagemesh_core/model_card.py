"""What the served model is, for the APIs that describe it to clients: the CLI fills it, the gateway reads it.

Contract: ``ModelCard`` is a frozen description of the served checkpoint (its family, file format, parameter
count, size on disk, quantization, shape and when its files last changed) and a ``digest`` that names it.
``stagemesh serve`` builds one from the model's spec (the gateway may not read checkpoints) and hands it to the
gateway in ``GatewayConfig.model_card``; Ollama's ``/api/tags``, ``/api/show`` and ``/api/ps`` read it. Every
field has a default meaning "not known", so a gateway started without a card still answers.
``parameter_size(count)`` writes a count as Ollama does (``134.52M``, ``7.6B``, ``8B``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelCard:
    family: str = ""  # the architecture (config.json's model_type, GGUF's general.architecture): "llama", "qwen3"
    format: str = ""  # the weights' file format: "gguf" or "safetensors"
    parameter_count: int = 0  # every weight element of the model, the tied embedding counted once
    size_bytes: int = 0  # the weight files on disk
    quantization_level: str = ""  # "Q4_1", "Q8_0", "Q4" (MLX 4-bit), "BF16" (unquantized) ...
    modified_at: float = 0.0  # Unix time the weight files last changed
    digest: str = ""  # sha256 hex naming the checkpoint (its path, size and time; not a hash of the weights)
    num_layers: int = 0
    hidden_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    vocab_size: int = 0
    context_length: int = 0  # the model's own (the served one is the gateway's max_model_len, which may be less)


def parameter_size(count: int) -> str:
    """``count`` as Ollama's ``details.parameter_size`` writes it: billions with one decimal, millions with two
    (none when whole), thousands with none."""
    if count >= 10**9:
        return _scaled(count / 10**9, 1) + "B"
    if count >= 10**6:
        return _scaled(count / 10**6, 2) + "M"
    if count >= 10**3:
        return f"{count / 10**3:.0f}K"
    return str(count)


def _scaled(number: float, decimals: int) -> str:
    return f"{number:.0f}" if number == int(number) else f"{number:.{decimals}f}"
