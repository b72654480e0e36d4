"""A stage as a service and a process: the top floor of ``stage_worker``.

``stage_process`` loads, connects and runs one serving stage; ``process_setup`` does what must happen before
MLX loads (launch, cores, GPU, BLAS); ``grpc_service`` answers control and health calls behind
``auth_interceptor``'s mesh-token check; ``memory`` measures the stage's memory and KV capacity;
``node_probe`` reports a node's memory and backend; ``harness`` runs a stage on a fixed job for tests and
benchmarks. Imports every room of ``stage_worker``; nothing imports it but ``__main__`` and the CLI.
"""
