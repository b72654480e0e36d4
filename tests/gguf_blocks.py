"""Random but valid GGML quantized blocks in llama.cpp's layouts, for GGUF files the tests write.

``random_blocks(qtype, rows, cols, rng)`` gives ``(rows, bytes per row)`` uint8: every code, sub-scale and
sub-min random, each block's float16 super-scales (``d``, and ``dmin``/``m`` where the type has one) finite and
sized so the weights come out around 0.05 in magnitude, like a small model's. ``gguf.quants.dequantize`` reads
them as the reference.
"""

from __future__ import annotations

import numpy as np
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q

# Byte offset of each float16 field in a block -> its typical size (a weight of ~0.05 over the codes' spread).
_FP16_FIELDS: dict[Q, dict[int, float]] = {
    Q.Q4_0: {0: 0.05 / 5},
    Q.Q4_1: {0: 0.05 / 5, 2: -0.05 * 1.5},
    Q.Q8_0: {0: 0.05 / 70},
    Q.Q5_0: {0: 0.05 / 9},
    Q.Q5_1: {0: 0.05 / 9, 2: -0.05 * 1.5},
    Q.IQ4_NL: {0: 0.05 / 70},
    Q.Q2_K: {80: 0.05 / 10, 82: 0.05 / 10 * 1.5},  # d, dmin
    Q.Q3_K: {108: 0.05 / 40},
    Q.Q4_K: {0: 0.05 / 250, 2: 0.05 / 250 * 7.5},  # d, dmin: d*sc*q - dmin*m centred near zero
    Q.Q5_K: {0: 0.05 / 500, 2: 0.05 / 500 * 15.5},
    Q.Q6_K: {208: 0.05 / 1300},
}


def random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid ``qtype`` blocks for a ``(rows, cols)`` tensor, as GGUF stores it (bytes per row)."""
    block_elements, block_bytes = GGML_QUANT_SIZES[qtype]
    assert cols % block_elements == 0, f"{qtype.name} rows hold whole {block_elements}-element blocks"
    n_blocks = rows * cols // block_elements
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    for at, size in _FP16_FIELDS[qtype].items():
        value = size * rng.uniform(0.5, 1.5, n_blocks)
        blocks[:, at : at + 2] = value.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(rows, -1)
