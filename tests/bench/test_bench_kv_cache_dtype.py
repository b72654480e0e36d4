"""``stagemesh bench compare --comparisons kv-cache-dtype``'s pure pieces: the servers it starts (auto first,
the dtype flag winning over ``--serve-args``, as ``stagemesh serve``'s own parser reads them), its long-context
default sizes and levels (flags win), and each server's KV capacity read from ``/metrics`` text and reported
against auto's."""

from __future__ import annotations

import argparse

from prometheus_client.parser import text_string_to_metric_families

from stagemesh import serve
from stagemesh.bench.compare import (
    COMPARISONS,
    _concurrency,
    _sizes,
    capacity_from_metrics,
    format_kv_capacity,
    kv_cache_dtype_servers,
)


def test_the_comparison_serves_auto_then_q8_then_q4_and_its_flag_wins_over_serve_args():
    assert "kv-cache-dtype" in COMPARISONS
    servers = kv_cache_dtype_servers(["--max-model-len", "4096", "--kv-cache-dtype", "q4",
                                      "--kv-cache-group-size", "32"])
    assert [label for label, _ in servers] == ["kv-auto", "kv-q8", "kv-q4"]
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    for (label, flags), name in zip(servers, ("auto", "q8", "q4")):
        args = parser.parse_args(flags)
        assert (args.kv_cache_dtype, args.kv_cache_group_size, args.max_model_len) == (name, 32, 4096), label


def test_its_workload_defaults_to_long_prompts_at_1_and_8_streams_and_flags_win():
    def args(**given):
        base = dict(input_len=None, output_len=None, num_prompts=None, concurrency=None, system_len=128,
                    user_len=16, conversations=8)
        return argparse.Namespace(**{**base, **given})

    assert _sizes(args(), "kv-cache-dtype") == (1024, 64, None)
    assert _concurrency(args(), "kv-cache-dtype") == "1,8"
    assert _concurrency(args(), "pp") == "1,16"  # the others keep theirs
    assert _sizes(args(input_len=512, output_len=32, num_prompts=8), "kv-cache-dtype") == (512, 32, 8)
    assert _concurrency(args(concurrency="4"), "kv-cache-dtype") == "4"


METRICS = """\
# HELP stagemesh_stage_kv_token_capacity Token positions of KV cache the stage's memory budget allows
# TYPE stagemesh_stage_kv_token_capacity gauge
stagemesh_stage_kv_token_capacity{replica="0",rank="0",member="0",host="127.0.0.1"} 1498029.0
stagemesh_stage_kv_token_capacity{replica="0",rank="1",member="0",host="127.0.0.1"} 1512000.0
# HELP stagemesh_stage_kv_tokens Token positions of KV cache the stage holds
# TYPE stagemesh_stage_kv_tokens gauge
stagemesh_stage_kv_tokens{replica="0",rank="0",member="0",host="127.0.0.1"} 12.0
"""


def test_a_servers_capacity_is_its_smallest_stages_and_each_is_stated_against_autos():
    assert capacity_from_metrics(text_string_to_metric_families(METRICS)) == 1498029
    assert capacity_from_metrics(text_string_to_metric_families("")) is None
    lines = format_kv_capacity({"kv-auto": 421320, "kv-q8": 1498029, "kv-q4": None})
    assert lines == ["kv-auto: KV for 421,320 tokens", "kv-q8: KV for 1,498,029 tokens, 3.56x of kv-auto",
                     "kv-q4: KV capacity unknown"]
