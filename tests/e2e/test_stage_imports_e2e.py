"""A stage process loads the real model without transformers or huggingface_hub (``stage_worker.model.lean_mlx_lm``).

A subprocess does what ``python -m stage_worker`` does up to serving: registers mlx-lm unexecuted, imports the
stage's modules, and loads and warms the default model as a PP=1 stage on the CPU (dequantized, as a CPU stage
with its BLAS runs it), then reports which of the tokenizer stack's packages it imported. mlx-lm's package itself
stays unexecuted while its model modules serve.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

_STAGE_START = """
import json, sys
from stage_worker.model import lean_mlx_lm
assert lean_mlx_lm.install()
from stage_worker.service.stage_process import load, resolve
from stage_worker.engine.stage_status import StageStatus
from stagemesh_core.plan import StageLaunch, StageOptions, make_local_plan
plan = make_local_plan(sys.argv[1], 30, 1, "auto", ring_base_port=30000, dequantize="on")
ctx = resolve(StageLaunch(plan, 0, StageOptions()))
loaded = load(ctx, StageStatus())
heavy = sorted({name.split(".")[0] for name in sys.modules} & {"transformers", "huggingface_hub", "tokenizers"})
front_door = hasattr(sys.modules["mlx_lm"], "load")
print(json.dumps({"heavy": heavy, "quantized": loaded.model.quantized, "mlx_lm_load": front_door}))
"""


def test_a_stage_loads_and_warms_the_default_model_without_the_tokenizer_stack(default_model_path):
    done = subprocess.run([sys.executable, "-c", _STAGE_START, default_model_path], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == {"heavy": [], "quantized": False, "mlx_lm_load": False}, report
