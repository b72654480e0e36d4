"""The GGUF format: ``format`` reads the container (header, metadata, a stage's tensors), ``quants`` turns
llama.cpp's block quantizations into MLX's affine ones, ``architectures`` maps each GGUF architecture's
tensor names and hyperparameters onto mlx-lm's. Imports the rest of ``checkpoint`` and nothing above it."""
