"""Ray at the edges: join or start a cluster, read its nodes, reserve bundles, shut down.

- ``connect_ray(units)``: join ``RAY_ADDRESS`` (or an explicit address), use a Ray already initialised in
  this process as is, or start a private local Ray **on loopback only** with ``units`` ``mlx`` units and no
  dashboard; a local node that comes up on another address is refused rather than silently used.
- ``cluster_nodes()``: the live nodes as ``placement.ClusterNode`` values.
- ``reserve_bundles(slots, timeout_s)``: a placement group with one ``{"mlx": 1, "CPU": 0.01}`` bundle per
  slot, each pinned to its slot's node (label ``ray.io/node-id``), ready within ``timeout_s`` or a
  ``PlacementError`` that says what is missing; never Ray's silent pending-forever.
- ``disconnect(session)``: ``ray.shutdown()`` if we called ``ray.init()`` (which also stops a local Ray we
  started).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

from coordinator.placement import ClusterNode, PlacementError, StageSlot
from stagemesh_core import settings
from stagemesh_core.settings import MLX_RESOURCE

log = logging.getLogger("stagemesh.coordinator")

LOOPBACK = "127.0.0.1"
RAY_ADDRESS_ENV = "RAY_ADDRESS"
BUNDLE_CPUS = 0.01
NODE_ID_LABEL = "ray.io/node-id"
_CLUSTER_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
GCS_PORT_WAIT_ENV = "RAY_gcs_server_port_wait_time_s"  # Ray's wait for its GCS's port (default 30 s)
GCS_PORT_WAIT_S = 120
NO_PRESTART_ENV = "RAY_prestart_worker_first_driver"  # Ray's idle workers for its first driver (default on)
LOCAL_START_ATTEMPTS = 2


class RayStartError(RuntimeError):
    """Ray could not be joined or started; the message says what to change."""


@dataclass(frozen=True)
class RaySession:
    address: str  # GCS address
    local: bool  # a private loopback Ray started by us
    owns_connection: bool  # we called ray.init(), so we call ray.shutdown()
    driver_node_id: str
    started_in_s: float


@contextmanager
def loopback_only() -> Iterator[None]:
    """Keep a locally started Ray on 127.0.0.1.

    Two Ray quirks make "loopback only" need more than ``_node_ip_address="127.0.0.1"`` (both hold for ray
    2.60 on Linux). Ray rewrites a loopback node address to the machine's outward interface
    (``resolve_ip_for_localhost``) unless clusters are disabled, which it does by default only on macOS and
    Windows; ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` keeps the node on 127.0.0.1 and every Ray listener (GCS,
    raylet, workers) bound to 127.0.0.1. And ``ray.init()`` without an address attaches to any Ray already
    running on the machine, so ``connect_ray`` starts its own with ``address="local"``.
    """
    from ray._private import ray_constants

    saved_env = os.environ.get(_CLUSTER_SWITCH)
    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_CLUSTER_SWITCH] = "0"  # inherited by the raylet and its workers
    ray_constants.ENABLE_RAY_CLUSTER = False  # read at call time by this process
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(_CLUSTER_SWITCH, None)
        else:
            os.environ[_CLUSTER_SWITCH] = saved_env


def connect_ray(mlx_units: int, *, address: str | None = None, num_cpus: int | None = None) -> RaySession:
    """Join ``address`` / ``RAY_ADDRESS``, reuse an initialised Ray, or start a loopback one."""
    import ray

    started = time.monotonic()
    address = address or os.environ.get(RAY_ADDRESS_ENV) or None
    if ray.is_initialized():
        return _session(local=False, owns=False, started=started)
    # No telemetry: the only network here is the package registries, and a
    # private mesh has nothing to report.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # A mesh runs actors only (a StageHost per stage, each on a worker of its own), so the idle task workers a
    # raylet starts for its first driver would only take CPU and memory (docs/performance.md has the figures).
    os.environ.setdefault(NO_PRESTART_ENV, "0")
    if address:
        # A cluster on loopback (one machine, tests) needs the same guard, or Ray
        # rewrites 127.0.0.1 in the address to the outward interface and fails.
        guard = loopback_only() if _is_loopback_address(address) else nullcontext()
        # With STAGEMESH_HOST_IP the driver attaches to this node's own Ray node, not to
        # whichever node Ray's process scan finds first.
        host_ip = settings.HOST_IP
        node_ip = {"_node_ip_address": host_ip} if host_ip else {}
        try:
            with guard:
                ray.init(address=address, log_to_driver=False, **node_ip)
        except Exception as exc:  # ConnectionError, ValueError, RuntimeError across versions
            raise RayStartError(
                f"could not join the Ray cluster at RAY_ADDRESS={address} ({exc}); start it "
                f"with `ray start --head --resources='{{\"{MLX_RESOURCE}\": 1}}'` on the head "
                f"Mac, or unset RAY_ADDRESS to run a local mesh on this machine. If the head "
                f"uses token authentication (Ray 2.60 turns it on when ~/.ray/auth_token exists), "
                f"give this machine the same token: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH"
            ) from exc
        return _session(local=False, owns=True, started=started)
    cpus = num_cpus if num_cpus is not None else max(1, os.cpu_count() or 1)
    # A busy machine can take Ray past its own 30 s waits: for the GCS to write its port (a setting, raised
    # here) and for the raylet to register (fixed in Ray), so a start that timed out is tried once more.
    os.environ.setdefault(GCS_PORT_WAIT_ENV, str(GCS_PORT_WAIT_S))
    for attempt in range(1, LOCAL_START_ATTEMPTS + 1):
        try:
            with loopback_only():
                ray.init(
                    address="local",  # never attach to another Ray already running here
                    _node_ip_address=LOOPBACK,
                    resources={MLX_RESOURCE: mlx_units},
                    num_cpus=cpus,
                    include_dashboard=False,
                    log_to_driver=False,
                )
            break
        except Exception as exc:  # Ray raises a bare Exception for the raylet's timeout
            if attempt == LOCAL_START_ATTEMPTS or not is_startup_timeout(exc):
                raise
            log.warning("the local Ray did not start (%s); trying again", exc)
            bounded(ray.shutdown, 30.0, "stopping a local Ray that did not start")
            # Ray never recorded a node that did not start, so ray.shutdown leaves its GCS, monitors and dashboard
            # running beside the next attempt's: stop them here (our own children).
            _kill_leftover_ray_processes()
    session = _session(local=True, owns=True, started=started)
    node_address = next(
        (n.address for n in cluster_nodes(session.driver_node_id) if n.node_id == session.driver_node_id), "?")
    if node_address != LOOPBACK:
        ray.shutdown()
        raise RayStartError(
            f"the local Ray node came up on {node_address}, not {LOOPBACK}; a local mesh "
            f"must stay on loopback. Set {_CLUSTER_SWITCH}=0 or use RAY_ADDRESS"
        )
    log.info("started a local Ray on %s with %d '%s' unit(s), %d CPU(s) in %.1f s",
             session.address, mlx_units, MLX_RESOURCE, cpus, session.started_in_s)
    return session


def is_startup_timeout(exc: BaseException) -> bool:
    """Whether ``exc`` is Ray giving up on its own daemons starting (pure): the raylet not registered, or the
    GCS port not written, in time. Anything else is not retried."""
    text = str(exc)
    return "timed out during startup" in text or "Timed out waiting for file" in text


def _is_loopback_address(address: str) -> bool:
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    return host in ("127.0.0.1", "localhost", "::1")


def _session(*, local: bool, owns: bool, started: float) -> RaySession:
    import ray

    context = ray.get_runtime_context()
    return RaySession(
        address=context.gcs_address, local=local, owns_connection=owns,
        driver_node_id=context.get_node_id(), started_in_s=time.monotonic() - started,
    )


def disconnect(session: RaySession | None) -> None:
    """Undo ``connect_ray``: shut Ray down only if we initialised it."""
    import ray

    if session is not None and session.owns_connection and ray.is_initialized():
        started = time.monotonic()
        bounded(ray.shutdown, 20.0, "ray.shutdown")
        if session.local:
            _kill_leftover_ray_processes()
        log.info("Ray %s in %.1f s", "stopped" if session.local else "disconnected",
                 time.monotonic() - started)


def _kill_leftover_ray_processes() -> None:
    """A local Ray's processes are our own children; none may outlive us (by pid, never by name)."""
    import psutil

    for child in psutil.Process().children(recursive=True):
        try:
            command = " ".join(child.cmdline())
            if "ray" in child.name() or "/ray/" in command or command.startswith("ray::"):
                child.kill()
        except psutil.Error:
            continue


def cluster_nodes(driver_node_id: str | None = None) -> list[ClusterNode]:
    """Live Ray nodes; the head is the driver's node (else Ray's own head node)."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive", n.get("alive"))]
    ids = {n["NodeID"] for n in alive}
    head_id = driver_node_id if driver_node_id in ids else next(
        (n["NodeID"] for n in alive if "node:__internal_head__" in n.get("Resources", {})), None)
    return [
        ClusterNode(
            node_id=n["NodeID"], address=n["NodeManagerAddress"],
            mlx_units=int(n.get("Resources", {}).get(MLX_RESOURCE, 0)),
            is_head=n["NodeID"] == head_id,
        )
        for n in alive
    ]


def head_address(nodes: Sequence[ClusterNode]) -> str | None:
    return next((n.address for n in nodes if n.is_head), None)


def reserve_bundles(slots: Sequence[StageSlot], timeout_s: float, name: str = ""):
    """A ready placement group: bundle i holds one ``mlx`` unit on ``slots[i].node_id``.

    Raises ``PlacementError`` (after removing the group) when Ray cannot place
    it within ``timeout_s``, e.g. when another job holds the units.
    """
    import ray
    from ray.exceptions import GetTimeoutError
    from ray.util.placement_group import placement_group, remove_placement_group

    bundles = [{MLX_RESOURCE: 1, "CPU": BUNDLE_CPUS} for _ in slots]
    group = placement_group(
        bundles, strategy="PACK", name=name,
        bundle_label_selector=[{NODE_ID_LABEL: s.node_id} for s in slots],
    )
    try:
        ray.get(group.ready(), timeout=timeout_s)
    except GetTimeoutError:
        remove_placement_group(group)
        wanted = ", ".join(f"replica {s.replica} rank {s.rank} on {s.address} ({s.node_id[:8]})" for s in slots)
        raise PlacementError(
            f"Ray could not reserve {len(slots)} '{MLX_RESOURCE}' unit(s) within {timeout_s:.0f} s "
            f"({wanted}). Another job may hold them, or a node left the cluster: check "
            f"`ray status`, free the units or add a node with `ray start --address=HEAD_IP:6379 "
            f"--resources='{{\"{MLX_RESOURCE}\": 1}}'`."
        ) from None
    return group


def bounded(action, timeout_s: float, what: str) -> bool:
    """Run ``action`` on a daemon thread for at most ``timeout_s``; False if it did not finish.

    Ray calls block forever when the local raylet is gone (a signal sent to the whole
    process group kills it first), and stopping must never hang on that.
    """
    done = threading.Event()

    def run() -> None:
        try:
            action()
        except Exception as exc:  # reported, not fatal: we are tearing down
            log.debug("%s: %s", what, exc)
        finally:
            done.set()

    threading.Thread(target=run, name=f"bounded-{what}", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("%s did not finish in %.0f s (Ray unresponsive); going on", what, timeout_s)
        return False
    return True


def release_bundles(group) -> None:
    """Remove a placement group (this also kills the actors still in it)."""
    from ray.util.placement_group import remove_placement_group

    bounded(lambda: remove_placement_group(group), 5.0, "removing a placement group")
