"""stagemesh's shared core: every contract that crosses a process or service boundary.

The services (``gateway``, ``stage_worker``, ``coordinator``) depend on this
package and never on each other; the ``stagemesh`` command sits on top of all
of them. The core imports only the standard library, protobuf and the
generated gRPC code, so any service (or a tool on a Mac without MLX) can load
it cheaply. ``tests/test_import_boundaries.py`` enforces both rules.

- ``v1``: the generated gRPC code of ``proto/stagemesh/core/v1/stage.proto``
  (proto package ``stagemesh.v1``).
- ``settings``: every environment variable with its default, the default
  ports, the ``mlx`` resource name, the installed version.
- ``defaults``: the serving defaults every part shares (``--max-num-seqs``,
  ``--memory-fraction``, tokens per batch, prefix-cache blocks, ...).
- ``sampling``: the sampling contract (``SamplingParams``, each field's range
  and default, the one ``check``, the proto and JSON conversions).
- ``errors``: ``UserError``, the base of "change this flag" errors.
- ``layer_split`` and ``ports``: which layers and which ports each stage owns.
- ``plan``: ``PipelinePlan`` (who runs which slice where) and ``StageLaunch``
  (the plan, a rank and the stage's ``StageOptions``: what the coordinator
  writes and a stage process reads).
- ``states``: ``StageState`` and ``ExitCode``, each with its one proto or
  meaning mapping.
- ``snapshots``: the mesh as the coordinator sees it (``GET /mesh``) and a
  stage's counters (``StageStats``), one shape each.
"""
