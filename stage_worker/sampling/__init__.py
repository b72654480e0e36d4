"""The last stage's choice of token: ``sampler`` (temperature, top-p/top-k, seeded), ``row_options``
(per-sequence logits processors and logprobs, batch-aware) and ``grammar`` (structured output with
llguidance). Imports: ``speculation`` (the verify layout), ``checkpoint``, ``stage_worker.batch``, the core."""
