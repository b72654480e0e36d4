"""The engine: what a stage does with each message, and on the entry stage, which requests run.

``scheduler`` decides each batch (pure: it imports only ``stage_worker.batch``, ``cache.prefix_cache`` and
speculation's pure rules); ``stage_runtime`` computes a stage's layers, passes hidden states on and samples
at the end; ``entry_engine`` takes requests from gRPC threads into the pipeline; ``launcher`` evaluates the
steps on their own thread; ``generation_job`` runs a fixed batch to completion; ``warmup`` compiles the
kernels at load; ``stage_status`` is the lifecycle and counters the service reads. Imports every room below
(``sampling``, ``speculation``, ``model``, ``transport``, ``cache``, ``checkpoint``) and never ``service``.
"""
