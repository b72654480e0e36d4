"""Placeholders: a graph built on an array before its bytes are written computes with the bytes written."""

import mlx.core as mx
import numpy as np
import pytest

from stage_worker.transport.build_ahead import Placeholder, writes_reach_device


def test_writes_into_mlx_memory_reach_the_computation_on_this_backend():
    assert writes_reach_device()


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32, mx.int32])
def test_a_graph_built_on_a_placeholder_computes_with_what_was_written_after(dtype):
    placeholder = Placeholder((2, 4), dtype)
    result = (placeholder.array.astype(mx.float32) + 1).sum(axis=1)  # built first
    values = mx.array([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=dtype)
    host = np.array(values.view(mx.uint16) if dtype == mx.bfloat16 else values)
    placeholder.write(host)
    assert np.array(result).tolist() == [14.0, 30.0]


def test_a_write_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="holds 3 elements, got 4"):
        Placeholder((3,), mx.int32).write(np.arange(4, dtype=np.int32))
