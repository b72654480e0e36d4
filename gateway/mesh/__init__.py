"""The gateway's side of the mesh: the gRPC client of the replicas' entry stages.

What lives here: ``replica_client.ReplicaClient`` (one channel per entry stage, failover, gRPC failures as
``APIError``), the replica choice (``balancer``: least outstanding, or a client's cache key) and the one
``GenerateStream`` call per entry stage that every generation rides (``stage_streams``).
May import: ``gateway.mesh``, ``gateway.http`` (its errors) and ``stagemesh_core``; never the core nor an API.
"""
