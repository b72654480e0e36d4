"""Port assignment: ring base+g, lanes just past the ring ports, gRPC base+g."""

import pytest

from stagemesh_core.plan import PipelinePlan, make_local_plan
from stagemesh_core.ports import PortRangeError, stage_ports


def test_global_stage_g_binds_base_plus_g():
    ports = stage_ports(2, 4, ring_base=32323, grpc_base=50051)
    assert (ports.ring, ports.lane, ports.grpc) == (32325, 32329, 50053)


def test_port_base_out_of_range_names_the_flag():
    with pytest.raises(PortRangeError, match="--ring-base-port 65534"):
        stage_ports(0, 2, ring_base=65534, grpc_base=50051)
    with pytest.raises(PortRangeError, match="--grpc-base-port 80"):
        stage_ports(0, 2, ring_base=32323, grpc_base=80)


def test_local_plan_round_trips_through_json_and_writes_the_ring_hostfile():
    plan = make_local_plan("/models/m.gguf", 30, 3, "float32", layer_split="12,24", ring_base_port=40000)
    assert [(s.layers.start, s.layers.end) for s in plan.stages] == [(0, 12), (12, 24), (24, 30)]
    assert plan.ring_hostfile() == [["127.0.0.1:40000"], ["127.0.0.1:40001"], ["127.0.0.1:40002"]]
    assert [s.lane_port for s in plan.stages] == [40003, 40004, 40005]
    assert PipelinePlan.from_json(plan.to_json()) == plan


def test_the_default_model_is_found_in_each_stages_own_installation():
    import pytest

    from stage_worker.checkpoint.default_model import default_model_path
    from stage_worker.checkpoint.model_spec import ModelFormatError
    from stage_worker.service.stage_process import resolve
    from stagemesh_core.plan import StageLaunch

    plan = make_local_plan("/Users/someone-else/venv/SmolLM2.gguf", 30, 2, "auto")
    with pytest.raises(ModelFormatError, match="/Users/someone-else/venv/SmolLM2.gguf"):
        resolve(StageLaunch(plan, 1))
    default = PipelinePlan.from_json(plan.to_json().replace('"model_is_default": false', '"model_is_default": true'))
    assert resolve(StageLaunch(default, 1)).spec.path == default_model_path()
