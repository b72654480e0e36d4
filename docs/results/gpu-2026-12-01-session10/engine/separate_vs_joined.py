"""Engine alone, 8B: separate vs joined projections on a mixed workload (random prompt/output lengths, 16 in flight)."""
import json, os, sys
from stage_worker.process_setup import serving_mlx_environment
os.environ.update(serving_mlx_environment(os.environ))
import mlx.core as mx
from stage_worker.model_spec import read_model_spec
from stage_worker.stage_model import StageModel, StageRole
from stagemesh.core.layer_split import LayerRange
from stagemesh.bench.engine import _drive, _drive_mixed
from stage_worker.warmup import warm_up, warmup_plan
from stagemesh.core.plan import StageOptions

res = {}
for shape in sys.argv[1].split(','):
    spec = read_model_spec(f"stagemesh/bench/model_configs/{shape}", load_format="dummy")
    for load in range(2):
        model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.bfloat16)
        for label in ("separate", "joined"):
            if label == "joined":
                model.fuse_projections()
            d = StageOptions()
            warm_up(model, warmup_plan("cuda", max_num_seqs=d.max_num_seqs, micro_batches=1,
                                       max_batch_tokens=d.max_batch_tokens, max_model_len=4096))
            _drive_mixed(model, 40, 16, 400, 64, 1, True, False)  # shapes of a mixed workload, warmed
            mixed = _drive_mixed(model, 200, 16, 400, 64, 0, True, False)
            many = _drive(model, 16, 64, 32, True, False)
            ones = [_drive(model, 1, 128, 32, True, False)["ms_per_token_p50"] for _ in range(3)]
            key = f"{shape} load{load} {label}"
            res[key] = {"mixed": {k: v for k, v in mixed.items() if k not in ("profile", "failures")},
                        "16_tok_s": many["tokens_per_s"], "1_ms_per_token": ones}
            print(key, res[key], flush=True)
        del model
        mx.clear_cache()
print(json.dumps(res))
