"""The stage's caches: the room for *adding a cache kind*.

``kv_store`` holds the keys and values (or recurrent state) of this stage's own layers, per sequence and per
decoding group, in mlx-lm's cache types; ``prefix_cache`` is the entry stage's pure bookkeeping of which token
prefixes the pipeline keeps (no MLX, so the scheduler may import it). Imports: ``stage_worker.batch`` and
``stagemesh_core``; nothing of the model, the transport or the engine.
"""
