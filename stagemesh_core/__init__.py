"""stagemesh's shared core: every contract that crosses a process or service boundary.

The services (``gateway``, ``stage_worker``, ``coordinator``) depend on this package and never on each other;
the ``stagemesh`` command sits on top of all of them. The core imports only the standard library, protobuf
and the generated gRPC code, so any service (or a tool on a Mac without MLX) can load it cheaply;
``tests/test_import_boundaries.py`` enforces both rules.

One contract per module: ``v1`` (the generated code of ``proto/stagemesh_core/v1/stage.proto``), ``settings``
(environment variables, default ports), ``defaults`` (serving defaults), ``sampling`` (``SamplingParams``),
``errors`` (``UserError``), ``layer_split`` and ``ports`` (which layers and ports each stage owns), ``plan``
(``PipelinePlan``, ``StageLaunch``), ``states`` (``StageState``, ``ExitCode``), ``snapshots`` (``GET /mesh``,
``StageStats``), ``events``, ``memory``, ``gpus``, ``grpc_tls``, ``mesh_token`` and ``speculative``.
"""
