"""How a token sequence is named block by block, for the stages' prefix cache and the gateway's prefix routing.

Contract: ``block_hashes(tokens, block_size, salt, limit)`` names block i of ``tokens`` (``block_size`` tokens
each; only whole blocks) by a 16-byte chained hash of every token up to the block's end and of ``salt``, so
equal hashes mean equal prefixes (pure). The entry stage salts with the model and compute dtype
(``stage_worker.cache.prefix_cache``); the gateway, which routes one model, hashes unsalted
(``gateway.mesh.prefix_routing``): both walk a prompt the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence


def block_hashes(tokens: Sequence[int], block_size: int, salt: bytes = b"", limit: int | None = None) -> list[bytes]:
    """Chained hashes of ``tokens``' whole blocks (at most ``limit`` of them) (pure)."""
    count = len(tokens) // block_size if limit is None else min(limit, len(tokens) // block_size)
    hashes = []
    previous = hashlib.blake2b(salt, digest_size=16).digest()
    for i in range(count):
        block = tokens[i * block_size:(i + 1) * block_size]
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in block))
        previous = digest.digest()
        hashes.append(previous)
    return hashes
