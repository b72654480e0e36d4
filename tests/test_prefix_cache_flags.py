"""``stagemesh serve``'s prefix-cache flags: on by default, off on request, a block size of at least one token."""

import argparse

import pytest

from stagemesh.serve import ServeConfigError, add_arguments, build_mesh_config
from stagemesh_core.errors import UserError
from stagemesh_core.plan import StageOptions


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_prefix_caching_is_on_by_default_and_can_be_turned_off():
    _, config = build_mesh_config(_args())
    assert (config.enable_prefix_caching, config.prefix_cache_block_size) == (True, 16)
    _, config = build_mesh_config(_args("--no-enable-prefix-caching", "--prefix-cache-block-size", "32"))
    assert (config.enable_prefix_caching, config.prefix_cache_block_size) == (False, 32)


def test_a_block_size_below_one_is_refused_naming_the_flag():
    with pytest.raises(ServeConfigError, match="--prefix-cache-block-size must be at least 1, got 0"):
        build_mesh_config(_args("--prefix-cache-block-size", "0"))
    with pytest.raises(UserError, match="prefix_cache_block_size"):
        StageOptions(prefix_cache_block_size=0)


def test_bench_prefix_refuses_non_positive_counts_before_loading_anything(capsys):
    from stagemesh.cli import main

    assert main(["bench", "prefix", "--turns", "0"]) == 2
    assert "stagemesh bench prefix: error: --conversations, --turns" in capsys.readouterr().err
