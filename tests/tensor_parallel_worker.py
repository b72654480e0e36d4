"""One member of a tensor-parallel group in its own process, for tests/test_tensor_parallel.py.

``python -m tests.tensor_parallel_worker CONFIG.json``: loads a model's whole stage (the default, or
``CONFIG["model"]``) in float32 with dense weights, joins MLX's ring (``MLX_RANK`` / ``MLX_HOSTFILE``) when the
group has more than one member and cuts its layers to its share (``stage_worker.parallel.tensor_parallel``),
loading lazily as a stage's worker does, then decodes each prompt greedily through the stage's packed path with
its own KV caches. Rank 0 writes the tokens of every step to ``CONFIG["out"]`` (their logits, float32, to
``CONFIG["out"] + ".logits.npy"``: [prompt, step, vocab]), with its share,
its weight bytes (the slice's and its layers' alone: the embedding and head stay whole), the whole slice's
bytes before the cut, its largest layer's, MLX's peak memory over the load and the cut, and the shapes its
caches hold after the first prompt (``cache_shapes``: per layer, the shape of every array of its cache).
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten


def main(config_path: str) -> None:
    with open(config_path) as f:
        config = json.load(f)
    from stage_worker.checkpoint.default_model import resolve_model_path
    from stage_worker.checkpoint.model_reader import read_model_spec
    from stage_worker.model.stage_model import StageModel, StageRole
    from stagemesh_core.layer_split import LayerRange

    spec = read_model_spec(resolve_model_path(config.get("model")))
    # As a stage's worker does: a group member loads lazily and evaluates its cut layer by layer.
    lazy = config["size"] > 1
    mx.reset_peak_memory()
    model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.float32,
                            evaluate=not lazy)
    model.dequantize(evaluate=not lazy)
    whole_bytes = model.weight_bytes
    largest_layer = max(sum(v.nbytes for _, v in tree_flatten(layer.parameters())) for layer in model.layers)
    share = None
    if config["size"] > 1:
        group = mx.distributed.init(backend="ring", strict=True)
        assert group.size() == config["size"], group.size()
        share = model.shard(group, rank_0_extra=spec.vocab_size * spec.hidden_size)  # as a last stage
    load_peak = mx.get_peak_memory()
    results, cache_shapes, every_logit = [], None, []
    for prompt in config["prompts"]:
        caches = model.new_caches()
        hidden = model.embed(mx.array(prompt, dtype=mx.int32))
        tokens, logits_seen = [], []
        for _ in range(config["steps"]):
            logits = model.logits(model.run_layers(hidden, caches)[-1:])
            token = int(mx.argmax(logits, axis=-1).item())
            tokens.append(token)
            logits_seen.append(logits[0])
            hidden = model.embed(mx.array([token], dtype=mx.int32))
        results.append({"tokens": tokens})
        every_logit.append(mx.stack(logits_seen))
        if cache_shapes is None:
            cache_shapes = [[list(a.shape) for a in cached_arrays(cache.state)] for cache in caches]
    if share is None or share.rank == 0:
        np.save(config["out"] + ".logits.npy", np.array(mx.stack(every_logit)))  # [prompt, step, vocab]
        with open(config["out"], "w") as f:
            json.dump({"results": results, "heads": None if share is None else len(share.heads),
                       "kv_heads": None if share is None else len(share.kv_heads),
                       "weight_bytes": model.weight_bytes, "cache_shapes": cache_shapes,
                       "whole_bytes": whole_bytes, "largest_layer_bytes": largest_layer, "load_peak_bytes": load_peak,
                       "layer_bytes": sum(v.nbytes for layer in model.layers
                                          for _, v in tree_flatten(layer.parameters()))}, f)


def cached_arrays(state: object) -> list[mx.array]:
    """Every array of a cache's state (a KV cache's keys and values, an arrays cache's entries), in order."""
    if isinstance(state, mx.array):
        return [state]
    if isinstance(state, (list, tuple)):
        return [a for part in state for a in cached_arrays(part)]
    return []


if __name__ == "__main__":
    from stage_worker.model import lean_mlx_lm

    lean_mlx_lm.install()  # as a stage's process does: mlx-lm's models without its tokenizer stack (4 s to import)
    main(sys.argv[1])
