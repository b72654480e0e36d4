"""Benchmarks: ``stagemesh bench KIND``, one module per kind, named after it.

- ``command``: the ``stagemesh bench`` command (the kinds and their dispatch);
  ``flags``: the flags kinds share; ``report``: the one report shape.
- Kinds: ``serve`` (load OpenAI endpoints), ``compare``, ``stack``,
  ``gateway``, ``engine``, ``prefix``, ``speculative``, ``pipeline``, ``experts``, ``hop``,
  ``parity``.
- What ``serve`` is built from: ``types`` (the frozen values), ``workload`` and
  ``conversation`` (prompts), ``load`` (sending them), ``stats`` (percentiles
  and ratios), ``serve_report`` / ``plot`` (its results, table and figure),
  ``profile`` (a stagemesh server's per-stage profile from its ``/metrics``),
  ``prefix_summary`` (the prefix comparison's verdict), ``random_checkpoint``
  (real-sized models with random weights).
"""
