"""Which servers each ``stagemesh bench compare`` comparison starts, and how servers side by side on one GPU
share its memory (``comparison_servers``, ``share_the_gpu``): pure decisions, checked without starting any."""

from __future__ import annotations

import pytest

from stagemesh.bench.compare import COMPARISONS, ServerSpec, comparison_servers, share_the_gpu


def _servers(name: str, backend: str = "cpu", serve_args: tuple[str, ...] = (), as_is: bool = False):
    made = []

    def dense_f32() -> str:
        made.append(1)
        return "/tmp/f32"

    servers = comparison_servers(name, "/m.gguf", "/tmp/q4", dense_f32, "/usr/lib/libopenblas.so", serve_args,
                                 as_is, backend, ncpu=2)
    return servers, bool(made)


@pytest.mark.parametrize("name", COMPARISONS)
def test_every_comparison_starts_named_servers_on_the_model(name):
    servers, _ = _servers(name)
    assert len(servers) >= 2 and len({s.label for s in servers}) == len(servers)
    assert all(s.model == "/m.gguf" for s in servers if not s.mlx_lm)


def test_prefix_compares_the_cache_off_first_then_on_then_mlx_lm_on_the_same_weights():
    servers, made = _servers("prefix", serve_args=("--max-num-seqs", "4"))
    assert [s.label for s in servers] == ["stagemesh-cache-off", "stagemesh", "mlx_lm"]
    assert servers[0].flags == ("--max-num-seqs", "4", "--no-enable-prefix-caching")  # the flag last wins
    assert servers[1].flags == ("--max-num-seqs", "4")
    assert made and servers[2].mlx_lm and servers[2].model == "/tmp/f32"
    assert dict(servers[2].env)["LD_PRELOAD"] == "/usr/lib/libopenblas.so"
    # A --shape checkpoint is read as it is; on a GPU mlx_lm.server needs no BLAS.
    shaped, made = _servers("prefix", backend="cuda", as_is=True)
    assert not made and shaped[2].model == "/m.gguf" and shaped[2].env == ()


def test_servers_side_by_side_on_a_gpu_split_the_default_memory_fraction():
    servers, _ = _servers("prefix", backend="cuda")
    shared = share_the_gpu(servers, "cuda")
    # 0.8 / 3, rounded down: together the serves plan no more than the default share of the GPU.
    assert [s.flags[-2:] for s in shared[:2]] == [("--memory-fraction", "0.26")] * 2
    assert shared[2] == servers[2]  # mlx_lm.server has no such flag
    two = share_the_gpu(_servers("pp", backend="metal")[0], "metal")
    assert all(s.flags[-2:] == ("--memory-fraction", "0.4") for s in two)


def test_the_cpu_and_a_given_memory_fraction_keep_the_servers_as_they_are():
    servers, _ = _servers("prefix")
    assert share_the_gpu(servers, "cpu") == servers
    given, _ = _servers("prefix", backend="cuda", serve_args=("--memory-fraction", "0.2"))
    assert share_the_gpu(given, "cuda") == given
    equals, _ = _servers("pp", backend="cuda", serve_args=("--memory-fraction=0.3",))
    assert share_the_gpu(equals, "cuda") == equals
    alone = [ServerSpec("one", "/m")]
    assert share_the_gpu(alone, "cuda") == alone


def test_an_unknown_comparison_is_a_programming_error():
    with pytest.raises(ValueError):
        _servers("nonesuch")
