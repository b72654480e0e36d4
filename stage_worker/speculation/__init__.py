"""Speculative decoding: ``rules`` (pure decisions and bookkeeping: what to verify, what was accepted),
``ngram_proposer`` (prompt lookup, pure) and ``draft_proposer`` (a small draft model on the entry stage, with
its KV in ``draft_batch``). ``rules`` and ``ngram_proposer`` import no MLX, so the scheduler may use them.
Imports: ``model``, ``cache``, ``checkpoint``, ``stage_worker.batch`` and ``stagemesh_core``."""
