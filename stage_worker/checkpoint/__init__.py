"""Checkpoints on disk: what a model is and how its weights are read, whatever the format.

The room for *adding a weight format*. ``model_spec`` says what a model is (config, architecture, files)
and ``model_reader`` reads it from a directory or a file; ``safetensors_format`` and ``gguf/`` (the GGUF
container, its K-quants and its architectures' tensor names) read a stage's own layers lazily;
``dummy_weights`` makes random ones; ``stage_weights`` picks the reader for a launch. ``mlx_arch`` tells
which mlx-lm architecture serves a config, ``first_layers`` cuts a config to its first layers,
``checkpoint_check`` refuses a checkpoint that does not match its config, ``load_progress`` counts bytes read.
``tokenizer``, ``default_model`` (the embedded model) and ``convert`` (GGUF to an MLX folder) complete it.

Imports: ``stagemesh_core`` only (the ground floor of the stage); no MLX at import time in ``model_spec``,
``default_model`` or ``tokenizer``, which the planner and the CLI read without a stage.
"""
