"""Which failures of a local Ray start are worth a second start (``coordinator.ray_cluster``)."""

from __future__ import annotations

from coordinator.ray_cluster import is_startup_timeout


def test_only_ray_giving_up_on_its_own_daemons_is_a_startup_timeout_worth_a_second_start():
    assert is_startup_timeout(Exception("The current node timed out during startup. This could happen because "
                                        "some of the raylet failed to startup or the GCS has become overloaded."))
    assert is_startup_timeout(RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_ab"))
    assert not is_startup_timeout(ValueError("resources must be a dict"))
    assert not is_startup_timeout(ConnectionError("could not connect to 10.0.0.1:6379"))
