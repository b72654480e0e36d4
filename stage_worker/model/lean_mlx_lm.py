"""mlx-lm's model modules in a stage process, without mlx-lm's package front door.

Contract: ``install()``, called at the top of a stage process before anything imports ``mlx_lm``, registers the
``mlx_lm`` package without running its ``__init__``. Submodules (``mlx_lm.models.*``, ``mlx_lm.sample_utils``,
and ``mlx_lm.utils`` where a stage asks for it) import as usual; only the package's top-level re-exports
(``mlx_lm.load``, ``mlx_lm.generate``, ``mlx_lm.convert``) are absent in that process, and no stage code uses
them. Anywhere else (the CLI, the gateway, tests, benchmarks) mlx-lm imports as usual.

Why: ``mlx_lm/__init__`` imports ``convert``, ``generate`` and ``utils``, and through them transformers and
huggingface_hub, a large part of a stage's start; a stage computes on token ids and imports a tokenizer only
when a request asks for structured output or speculative drafts (docs/performance.md, "A stage's start", has
the figures).
"""

from __future__ import annotations

import importlib.util
import sys

PACKAGE = "mlx_lm"


def install() -> bool:
    """Register ``mlx_lm`` unexecuted; False (nothing changed) where it is already imported or not installed."""
    if PACKAGE in sys.modules:
        return False
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or spec.submodule_search_locations is None:
        return False
    # A package module built from its spec but not executed: its __path__ is set, so ``import mlx_lm.models.x``
    # finds the submodule, and ``mlx_lm/__init__.py`` never runs in this process.
    sys.modules[PACKAGE] = importlib.util.module_from_spec(spec)
    return True
