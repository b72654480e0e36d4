"""Serving defaults every part shares, defined once: the CLI's flag defaults, ``StageOptions``, the layer
planner's request, the scheduler and the benchmarks all read them from here.

Environment variables and their defaults live in ``stagemesh_core.settings``; these are the values a flag
(or a ``StageOptions`` field) takes when it is left unset.
"""

from __future__ import annotations

MAX_NUM_SEQS = 64  # --max-num-seqs: sequences a replica runs at once
MAX_WAITING = 256  # requests queued beyond the running ones
MEMORY_FRACTION = 0.8  # --memory-fraction: share of a host's (or its GPU's) memory its stages may use
MAX_BATCH_TOKENS = 512  # token rows per batch (long prompts are prefilled in chunks of at most this many)
ENABLE_PREFIX_CACHING = True  # --enable-prefix-caching (vLLM's default too)
PREFIX_CACHE_BLOCK_SIZE = 16  # --prefix-cache-block-size: tokens per prefix-cache block (vLLM's --block-size)
MAX_MODEL_LEN = 4096  # the context length when neither --max-model-len nor the model's config says one
STARTUP_TIMEOUT_S = 300.0  # --startup-timeout: every stage loaded and in its ring by then
CONNECT_TIMEOUT_S = 60.0  # a stage's neighbours' lanes must be up by then
