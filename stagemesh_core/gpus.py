"""Which GPU a stage computes on, on a node with several: the rule the coordinator and a stage share.

MLX computes on device 0 of the GPUs its process can see, so two stages on one NVIDIA host would both compute
on GPU 0 while the others idle. The coordinator therefore gives each stage a ``gpu_index`` (``StageOptions``):
an index into *the node's visible GPUs*, the entries of ``CUDA_VISIBLE_DEVICES`` when the node's environment
sets it, else every GPU ``nvidia-smi -L`` lists. The node's StageHost counts them (``node_gpu_count``); the
stage, before MLX loads, narrows its own ``CUDA_VISIBLE_DEVICES`` to that one entry
(``stage_gpu_environment``), so inside the stage its GPU is device 0. Metal and CPU nodes count 0 GPUs:
nothing to assign (a Mac has one GPU, shared by its stages). ``STAGEMESH_GPU_PER_STAGE=off`` on a node leaves
its stages' ``CUDA_VISIBLE_DEVICES`` as the node sets it (to pin GPUs by hand).

Pure functions over plain values; the callers read the environment and run ``nvidia-smi``.
"""

from __future__ import annotations

from collections.abc import Mapping

CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
GPU_PER_STAGE_CHOICES = ("auto", "off")
# Set in a stage's environment once it narrowed CUDA_VISIBLE_DEVICES: the stage re-executes itself
# (to preload a BLAS), and its second pass must not index into the list it already narrowed.
APPLIED_MARK = "_STAGEMESH_STAGE_GPU"


def visible_devices(env: Mapping[str, str]) -> list[str] | None:
    """The GPUs ``CUDA_VISIBLE_DEVICES`` lists (indices, UUIDs or MIG ids), or None when it is unset."""
    raw = env.get(CUDA_VISIBLE_DEVICES)
    if raw is None:
        return None
    entries = []
    for entry in raw.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):  # CUDA ignores everything from the first invalid entry on
            break
        entries.append(entry)
    return entries


def count_listed_gpus(nvidia_smi_list: str | None) -> int:
    """GPUs in ``nvidia-smi -L`` output: one ``GPU i: NAME (UUID: ...)`` line each (MIG lines are indented)."""
    if not nvidia_smi_list:
        return 0
    return sum(1 for line in nvidia_smi_list.splitlines() if line.startswith("GPU "))


def node_gpu_count(env: Mapping[str, str], nvidia_smi_list: str | None) -> int:
    """GPUs a node's stages may be spread over: ``CUDA_VISIBLE_DEVICES`` if set, else ``nvidia-smi -L``'s, else 0."""
    visible = visible_devices(env)
    if visible is not None:
        return len(visible)
    return count_listed_gpus(nvidia_smi_list)


def gpu_per_stage(setting: str) -> bool:
    """``STAGEMESH_GPU_PER_STAGE``: whether a stage narrows ``CUDA_VISIBLE_DEVICES`` to its own GPU."""
    return setting == "auto"


def stage_gpu_environment(gpu_index: int | None, setting: str, env: Mapping[str, str]) -> dict[str, str]:
    """Variables a stage given ``gpu_index`` sets before MLX loads; empty when it keeps the node's GPUs.

    The stage's GPU is entry ``gpu_index`` of the node's ``CUDA_VISIBLE_DEVICES`` when that is set
    (taken modulo its length, should the node's list have shrunk since the coordinator counted it),
    else the physical GPU ``gpu_index``.
    """
    if gpu_index is None or not gpu_per_stage(setting):
        return {}
    if CUDA_VISIBLE_DEVICES in env and env.get(APPLIED_MARK) == env[CUDA_VISIBLE_DEVICES]:
        return {}  # narrowed already, before this process re-executed itself
    visible = visible_devices(env)
    if visible is None:
        device = str(gpu_index)
    elif visible:
        device = visible[gpu_index % len(visible)]
    else:
        return {}  # the node hides every GPU: nothing to choose from
    return {CUDA_VISIBLE_DEVICES: device, APPLIED_MARK: device}


def stage_has_own_gpu(gpu_index: int | None, setting: str) -> bool:
    """Whether the stage computes on the one GPU the coordinator gave it (so shares it only with the
    stages given the same one), rather than on whatever the node's environment leaves visible."""
    return gpu_index is not None and gpu_per_stage(setting)
