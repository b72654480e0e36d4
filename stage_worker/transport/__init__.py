"""How a hop leaves the process: the room for *adding a hop transport*.

``wire`` is the one home of every byte offset between neighbouring stages (headers, records, bodies,
payloads); ``links`` are the two lanes of a hop (TCP control and the payload's transport, ``lane`` or MLX's
``ring``); ``handshake`` connects a stage to both neighbours at start; ``build_ahead`` lets a stage build its
graph before the payload's bytes arrive. Imports: ``stage_worker.batch`` and ``stagemesh_core`` only.
"""
