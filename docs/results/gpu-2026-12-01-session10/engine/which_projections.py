"""Engine alone (bench-engine's driver), which projections are joined: none, qkv, gate_up, both."""
import json, os, sys, time
from stage_worker.process_setup import serving_mlx_environment
os.environ.update(serving_mlx_environment(os.environ))
import mlx.core as mx
from stage_worker.model_spec import read_model_spec
from stage_worker.stage_model import StageModel, StageRole
from stage_worker import fused_projections as fp
from stagemesh.core.layer_split import LayerRange
from stagemesh.bench.engine import _drive
from stage_worker.warmup import warm_up, warmup_plan
from stagemesh.core.plan import StageOptions

def join(model, what):
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if what == "qkv":
            attn.qkv_proj = fp._joined([attn.q_proj, attn.k_proj, attn.v_proj])
            for n in ("q_proj", "k_proj", "v_proj"): delattr(attn, n)
            mx.eval(attn.qkv_proj.parameters())
        else:
            mlp.gate_up_proj = fp._joined([mlp.gate_proj, mlp.up_proj])
            delattr(mlp, "gate_proj"); delattr(mlp, "up_proj")
            mx.eval(mlp.gate_up_proj.parameters())

res = {}
for shape in sys.argv[1].split(","):
    spec = read_model_spec(f"stagemesh/bench/model_configs/{shape}", load_format="dummy")
    for plan in (["none", "+qkv", "+gate_up"], ["+gate_up"]):
        model = StageModel.load(spec, StageRole(LayerRange(0, spec.num_layers), True, True), mx.bfloat16)
        label = ""
        for step in plan:
            if step != "none":
                join(model, step[1:])
            label = (label + step) if step != "none" else "none"
            d = StageOptions()
            warm_up(model, warmup_plan("cuda", max_num_seqs=d.max_num_seqs, micro_batches=1,
                                       max_batch_tokens=d.max_batch_tokens, max_model_len=4096))
            for rep in range(2):
                one = _drive(model, 1, 64, 32, True, False)
                many = _drive(model, 16, 64, 32, True, False)
                key = f"{shape} {label} r{rep}"
                res[key] = {"1_ms_per_token": one["ms_per_token_p50"], "16_tok_s": many["tokens_per_s"]}
                print(key, res[key], flush=True)
        del model
        mx.clear_cache()
print(json.dumps(res))
