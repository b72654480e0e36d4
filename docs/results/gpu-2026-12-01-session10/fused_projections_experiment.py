"""Decode step, step-ahead: mlx-lm's model vs fused q/k/v + gate/up projections, with / without mx.compile."""
import json, sys, time
import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.activations import swiglu
SHAPES = {"1b": dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
          "8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False)}

def fused_forward(model, compiled):
    inner = model.model
    fns = []
    for layer in inner.layers:
        a, m = layer.self_attn, layer.mlp
        wqkv = mx.concatenate([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]); wgu = mx.concatenate([m.gate_proj.weight, m.up_proj.weight])
        mx.eval(wqkv, wgu)
        inter = m.gate_proj.weight.shape[0]
        def pre(h, layer=layer, wqkv=wqkv):
            return layer.input_layernorm(h) @ wqkv.T
        def post(h, o, layer=layer, wgu=wgu, inter=inter):
            h = h + layer.self_attn.o_proj(o)
            y = layer.post_attention_layernorm(h) @ wgu.T
            return h + layer.mlp.down_proj(swiglu(y[..., :inter], y[..., inter:]))
        fns.append((mx.compile(pre), mx.compile(post)) if compiled else (pre, post))
    def forward(tokens, cache):
        h = inner.embed_tokens(tokens)  # [B, 1, D]
        B, L, _ = h.shape
        for layer, c, (pre, post) in zip(inner.layers, cache, fns):
            attn = layer.self_attn
            H, K = attn.n_heads, attn.n_kv_heads
            t = pre(h).reshape(B, L, H + 2 * K, -1).transpose(0, 2, 1, 3)
            q, k, v = t[:, :H], t[:, H:H + K], t[:, H + K:]
            q = attn.rope(q, offset=c.offset); k = attn.rope(k, offset=c.offset)
            k, v = c.update_and_fetch(k, v)
            o = scaled_dot_product_attention(q, k, v, cache=c, scale=attn.scale, mask="causal" if L > 1 else None)
            h = post(h, o.transpose(0, 2, 1, 3).reshape(B, L, -1))
        h = inner.norm(h)
        return model.lm_head(h) if hasattr(model, "lm_head") else inner.embed_tokens.as_linear(h)
    return forward

def unfused_forward(model, compiled):
    inner = model.model
    fns = []
    for layer in inner.layers:
        def pre(h, layer=layer):
            x = layer.input_layernorm(h); a = layer.self_attn
            return a.q_proj(x), a.k_proj(x), a.v_proj(x)
        def post(h, o, layer=layer):
            h = h + layer.self_attn.o_proj(o)
            return h + layer.mlp(layer.post_attention_layernorm(h))
        fns.append((mx.compile(pre), mx.compile(post)) if compiled else (pre, post))
    def forward(tokens, cache):
        h = inner.embed_tokens(tokens)
        B, L, _ = h.shape
        for layer, c, (pre, post) in zip(inner.layers, cache, fns):
            attn = layer.self_attn
            q, k, v = pre(h)
            q = q.reshape(B, L, attn.n_heads, -1).transpose(0, 2, 1, 3)
            k = k.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = v.reshape(B, L, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q = attn.rope(q, offset=c.offset); k = attn.rope(k, offset=c.offset)
            k, v = c.update_and_fetch(k, v)
            o = scaled_dot_product_attention(q, k, v, cache=c, scale=attn.scale, mask="causal" if L > 1 else None)
            h = post(h, o.transpose(0, 2, 1, 3).reshape(B, L, -1))
        h = inner.norm(h)
        return model.lm_head(h) if hasattr(model, "lm_head") else inner.embed_tokens.as_linear(h)
    return forward

res = {}
for name in sys.argv[1].split(","):
    args = llama.ModelArgs(model_type="llama", vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0, **SHAPES[name])
    model = llama.Model(args); model.set_dtype(mx.bfloat16); mx.eval(model.parameters())
    variants = {"mlx-lm": lambda t, c: model(t, cache=c), "split": unfused_forward(model, False),
                "split-compiled": unfused_forward(model, True), "fused": fused_forward(model, False),
                "fused-compiled": fused_forward(model, True)}
    for batch in (1, 16):
        outs = {}
        for rep in range(2):
            for vname, fwd in variants.items():
                cache = make_prompt_cache(model)
                y = mx.array([[1 + i for i in range(32)]] * batch)
                logits = fwd(y, cache); y = mx.argmax(logits[:, -1, :], axis=-1); mx.eval(y)
                times, builds = [], []
                n = 120
                nxt = mx.argmax(fwd(y[:, None], cache)[:, -1, :], axis=-1); mx.async_eval(nxt)
                toks = []
                for i in range(n):
                    t = time.perf_counter()
                    cur = nxt
                    nxt = mx.argmax(fwd(cur[:, None], cache)[:, -1, :], axis=-1); mx.async_eval(nxt)
                    t2 = time.perf_counter()
                    toks.append(cur.tolist())
                    times.append(time.perf_counter() - t); builds.append(t2 - t)
                outs[vname] = toks
                times = sorted(times[20:]); builds = sorted(builds[20:])
                key = f"{name}-b{batch}-{vname}-r{rep}"
                res[key] = {"step_ms": round(times[len(times)//2] * 1e3, 3), "build_ms": round(builds[len(builds)//2] * 1e3, 3)}
                print(key, res[key], flush=True)
        ref = outs["mlx-lm"]
        print(name, batch, "same tokens as mlx-lm:", {k: v == ref for k, v in outs.items()}, flush=True)
print(json.dumps(res))
