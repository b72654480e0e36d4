"""The model slice and its compute: a stage's layers, run on its device.

``stage_model`` builds a stage's slice of an mlx-lm model from its weights; ``layer_stack`` runs any stack
of layers as mlx-lm does; ``packed_forward`` is the packed decode path (``fused_projections``,
``sibling_projections``, ``masked_decode_kernel``), ``expert_routing`` the mixture-of-experts blocks.
``device`` and ``blas`` say where and how it computes, ``lean_mlx_lm`` imports mlx-lm's model modules without
its front door, ``model_facts`` sizes a model for the planner. Imports: ``checkpoint``, ``cache``, ``parallel``,
``stage_worker.batch`` and ``stagemesh_core``.
"""
