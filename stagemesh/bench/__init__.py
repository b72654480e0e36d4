"""Benchmarks: ``stagemesh bench`` (load against OpenAI endpoints), ``bench-serving`` (the
serving comparisons, side by side) and ``bench-pipeline`` (per-stage memory and bare decode).

- ``command``: the ``stagemesh bench`` CLI; ``serving`` and ``pipeline`` the other two.
- ``types``: the frozen values (endpoints, prompts, request records, plans).
- ``workload``: prompts; ``load``: sending them; ``stats``: percentiles and ratios;
  ``report`` / ``plot``: the JSON document, the table and the figure; ``profile``:
  a stagemesh server's per-stage profile from its ``/metrics``.
"""
