"""Experiment: PP=2 decode with each stage's next graph built ahead (ring send/recv inside the graph)
against the serial lane pattern, and PP=1 step-ahead as reference. Random weights, mlx-lm llama.

usage: python ahead.py SHAPE_DIR STEPS BATCH MICRO [layers_override]
"""
import json, os, socket, subprocess, sys, tempfile, time, statistics
from pathlib import Path


def model_half(cfg, rank, nl, dtype):
    import mlx.core as mx
    from mlx_lm.models import llama
    args = llama.ModelArgs.from_dict({**cfg, "num_hidden_layers": nl})
    m = llama.Model(args)
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m


def lane(rank, port):
    if rank == 1:
        ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", port)); ls.listen(1); s, _ = ls.accept(); ls.close()
    else:
        while True:
            try:
                s = socket.create_connection(("127.0.0.1", port)); break
            except OSError:
                time.sleep(0.05)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def recvn(s, n):
    b = bytearray(n); v = memoryview(b); g = 0
    while g < n:
        k = s.recv_into(v[g:]); assert k; g += k
    return b


def rank_main(cfg, steps, batch, micro, out):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache
    group = mx.distributed.init(backend="ring", strict=True)
    rank = group.rank(); peer = 1 - rank
    dtype = mx.bfloat16
    L = cfg["num_hidden_layers"]; H = cfg["hidden_size"]
    m = model_half(cfg, rank, L // 2, dtype)
    inner = m.model
    sock = lane(rank, int(os.environ["LANE_PORT"]))
    rows = batch // micro
    res = {}

    def layers(h, caches):
        from mlx_lm.models.base import create_attention_mask
        mask = create_attention_mask(h, caches[0])
        for layer, c in zip(inner.layers, caches):
            h = layer(h, mask, c)
        return h

    def head(h):
        h = inner.norm(h)
        return m.lm_head(h) if not m.args.tie_word_embeddings else inner.embed_tokens.as_linear(h)

    prompt_len = 16
    def fresh():
        return [[KVCache() for _ in inner.layers] for _ in range(micro)]

    def prefill_tokens():
        return [mx.array(np.arange(1, prompt_len + 1)[None].repeat(rows, 0), dtype=mx.int32) for _ in range(micro)]

    # ---- serial lane pattern: host round trip per hop ----
    def serial():
        caches = fresh()
        toks = prefill_tokens()
        stamps = []
        for step in range(steps):
            for g in range(micro):
                if rank == 0:
                    h = layers(inner.embed_tokens(toks[g]), caches[g])
                    mx.eval(h)
                    b = np.array(h.astype(mx.float32) if False else h.view(mx.uint16)).tobytes()
                    sock.sendall(len(b).to_bytes(8, "little") + b)
            for g in range(micro):
                if rank == 0:
                    n = int.from_bytes(recvn(sock, 8), "little")
                    t = np.frombuffer(recvn(sock, n), dtype=np.int32).reshape(rows, 1)
                    toks[g] = mx.array(t)
                else:
                    n = int.from_bytes(recvn(sock, 8), "little")
                    raw = np.frombuffer(recvn(sock, n), dtype=np.uint16)
                    h = mx.array(raw).view(dtype).reshape(rows, -1, H)
                    t = mx.argmax(head(layers(h, caches[g]))[:, -1:, :], axis=-1).astype(mx.int32)
                    mx.eval(t)
                    b = np.array(t).tobytes()
                    sock.sendall(len(b).to_bytes(8, "little") + b)
            if rank == 0:
                stamps.append(time.perf_counter())
        return stamps, [np.array(t).ravel().tolist() for t in toks]

    # ---- graph ahead: ring ops in the graph, next step queued before this one's token is read ----
    def ahead(depth):
        caches = fresh()
        toks = prefill_tokens()
        stamps = []
        pending = []  # (group, array to read), oldest first
        shape0 = [(rows, prompt_len, H)] + [(rows, 1, H)] * (steps - 1)
        def drain(limit):
            while len(pending) > limit:
                g, p = pending.pop(0)
                if rank == 0:
                    np.array(p)
                    if g == micro - 1:
                        stamps.append(time.perf_counter())
                else:
                    mx.eval(p)
        for step in range(steps):
            for g in range(micro):
                if rank == 0:
                    if step > 0:
                        toks[g] = mx.distributed.recv((rows, 1), mx.int32, peer, group=group)
                        mx.async_eval(toks[g])
                        pending.append((g, toks[g]))
                    h = layers(inner.embed_tokens(toks[g]), caches[g])
                    mx.async_eval(mx.distributed.send(h, peer, group=group))
                else:
                    h = mx.distributed.recv(shape0[step], dtype, peer, group=group)
                    t = mx.argmax(head(layers(h, caches[g]))[:, -1:, :], axis=-1).astype(mx.int32)
                    s = mx.distributed.send(t, peer, group=group)
                    mx.async_eval(s)
                    pending.append((g, s))
                # bound how far the host runs ahead
                drain(depth * micro)
        if rank == 0:
            for g in range(micro):
                toks[g] = mx.distributed.recv((rows, 1), mx.int32, peer, group=group)
                pending.append((g, toks[g]))
        drain(0)
        return stamps, [np.array(t).ravel().tolist() for t in toks]

    arms = [("serial", serial), ("ahead1", lambda: ahead(1)), ("ahead2", lambda: ahead(2)),
            ("serial_b", serial), ("ahead1_b", lambda: ahead(1))]
    if os.environ.get("ARMS"):
        arms = [a for a in arms if a[0] in os.environ["ARMS"].split(",")]
    import faulthandler; faulthandler.dump_traceback_later(int(os.environ.get("DUMP_S", "100")))
    for name, fn in arms:
        sock.sendall(b"x"); recvn(sock, 1)  # align
        stamps, last = fn()
        if rank == 0:
            gaps = [b - a for a, b in zip(stamps[5:], stamps[6:])]
            res[name] = {"step_ms_p50": round(statistics.median(gaps) * 1e3, 3),
                         "step_ms_mean": round(statistics.mean(gaps) * 1e3, 3), "last": last[0][:4]}
            print(name, res[name], flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(res))


def pp1(cfg, steps, batch):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache
    m = model_half(cfg, 0, cfg["num_hidden_layers"], mx.bfloat16)
    res = {}
    for name, ahead in [("pp1_sync", False), ("pp1_ahead", True), ("pp1_ahead_b", True)]:
        caches = [KVCache() for _ in m.layers]
        tok = mx.array(np.arange(1, 17)[None].repeat(batch, 0), dtype=mx.int32)
        stamps = []
        def step(t):
            return mx.argmax(m(t, cache=caches)[:, -1:, :], axis=-1).astype(mx.int32)
        if ahead:
            nxt = step(tok); mx.async_eval(nxt)
            for _ in range(steps):
                cur = nxt
                nxt = step(cur); mx.async_eval(nxt)
                np.array(cur); stamps.append(time.perf_counter())
        else:
            for _ in range(steps):
                tok = step(tok); mx.eval(tok); np.array(tok); stamps.append(time.perf_counter())
        gaps = [b - a for a, b in zip(stamps[5:], stamps[6:])]
        res[name] = {"step_ms_p50": round(statistics.median(gaps) * 1e3, 3)}
        print(name, res[name], flush=True)
    return res


if __name__ == "__main__":
    if sys.argv[1] == "--rank":
        cfg = json.loads(Path(sys.argv[2]).read_text())
        if len(sys.argv) > 7:
            cfg["num_hidden_layers"] = int(sys.argv[7])
        rank_main(cfg, int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
        sys.exit(0)
    shape, steps, batch, micro = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    extra = sys.argv[5:6]
    cfgp = str(Path(shape) / "config.json")
    gpus = os.environ.get("GPUS", "")
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "h.json"
        hf.write_text(json.dumps([["127.0.0.1:29410"], ["127.0.0.1:29411"]]))
        out = str(Path(tmp) / "r.json")
        procs = []
        for r in (0, 1):
            env = {**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hf), "LANE_PORT": "29412"}
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = gpus.split(",")[r]
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank", cfgp, str(steps), str(batch),
                                           str(micro), out] + extra, env=env))
        codes = [p.wait(500) for p in procs]
        print("codes", codes)
        res = json.loads(Path(out).read_text())
    cfg = json.loads(Path(cfgp).read_text())
    if extra:
        cfg["num_hidden_layers"] = int(extra[0])
    if gpus:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpus.split(",")[0]
    res.update(pp1(cfg, steps, batch))
    print("RESULT", json.dumps({"shape": shape, "batch": batch, "micro": micro, **res}))
