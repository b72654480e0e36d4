"""What this node says about its memory and backend: ``python -m stage_worker.service.node_probe`` prints it as JSON.

The layer planner must plan with each node's own numbers, read where the node
runs, never assumed from the head: a 24 GB Mac mini beside a 128 GB Mac Studio
is the case it exists for. The StageHost actor on each node runs this module
as a subprocess (the coordinator may not import ``stage_worker``, and a
subprocess sees exactly what a stage started there will see: the same MLX, the
same environment, ``STAGEMESH_NODE_MEMORY`` and ``STAGEMESH_NODE_SPEED``
included). ``stagemesh plan`` without Ray calls ``node_memory()`` directly.
"""

from __future__ import annotations

import json
import sys

from stage_worker.model.device import probe
from stagemesh_core import settings
from stagemesh_core.memory import NodeMemory


def node_memory() -> NodeMemory:
    """This node's ``NodeMemory``: MLX's backend and device (``model.device.probe``), psutil's host memory."""
    import psutil  # lazily, as every other module that reads the host's memory

    device = probe()
    memory = psutil.virtual_memory()
    return NodeMemory(backend=device.backend, device=device.name, host_total=int(memory.total),
                      host_available=int(memory.available), device_total=device.memory_bytes,
                      device_free=device.free_bytes, cap=settings.NODE_MEMORY, speed=settings.NODE_SPEED)


def main() -> int:
    print(json.dumps(node_memory().to_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
