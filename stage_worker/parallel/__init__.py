"""Tensor parallelism inside a stage: the room for *adding an architecture's cut*.

``tensor_parallel`` decides which part of each layer a group member holds and cuts mlx-lm's modules to it
(our packed-path split, mlx-lm's own ``shard()``, and ``SHARDERS`` for the architectures mlx-lm cannot cut);
``share_reads`` traces what a cut keeps of each stored tensor and reads only that part from the files.
Imports: ``checkpoint`` (where tensors lie in their files), ``stage_worker.batch`` and ``stagemesh_core``.
"""
