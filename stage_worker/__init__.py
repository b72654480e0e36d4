"""One pipeline stage: its slice of the model, its KV caches, its links to both neighbours and, on the entry
stage, the engine and the gRPC service. ``python -m stage_worker`` runs a serving stage (``__main__``);
``stage_worker.service.harness`` runs one on a fixed job."""
