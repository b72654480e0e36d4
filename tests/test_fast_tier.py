"""The fast tier's guard (tests/fast_tier.py) fails an unmarked test that starts a process, Ray or the real model,
and lets a marked one, or an unmarked one that only reads the model's header, through."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A pytest session of its own (a process: so this test is itself e2e) with the guard as its only plugin.
pytestmark = pytest.mark.e2e

INNER = '''
import ctypes.util
import multiprocessing
import subprocess

import pytest
import ray

from stage_worker.checkpoint.default_model import default_model_path
from stage_worker.checkpoint.model_reader import read_model_spec
from stage_worker.checkpoint.stage_weights import load_stage_weights


def test_unmarked_runs_a_command():
    subprocess.run(["true"])


def test_unmarked_swallows_what_the_guard_raised():
    try:
        subprocess.run(["true"])
    except Exception:
        pass


def test_unmarked_starts_a_multiprocessing_process():
    multiprocessing.get_context("spawn").Process(target=print).start()


def test_unmarked_starts_ray():
    ray.init(num_cpus=1)


def test_unmarked_loads_the_real_weights():
    load_stage_weights(read_model_spec(default_model_path()), range(0, 1), False, False)


def test_unmarked_reads_the_header_and_lets_the_stdlib_ask_the_os():
    assert read_model_spec(default_model_path()).num_layers == 30
    ctypes.util.find_library("c")  # runs ldconfig: the standard library's question, not the test's process


@pytest.mark.e2e
def test_marked_may_start_a_process_and_load_the_weights():
    subprocess.run(["true"], check=True)
    load_stage_weights(read_model_spec(default_model_path()), range(0, 1), False, False)
'''


def test_the_guard_fails_exactly_the_unmarked_slow_tests(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    pytester.makeini("[pytest]\nmarkers =\n    e2e: the slow tier\n")
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_subprocess("-p", "tests.fast_tier", "-p", "no:cacheprovider", "-rfEp")
    result.assert_outcomes(passed=2, failed=5)
    result.stdout.fnmatch_lines_random([
        "*test_unmarked_runs_a_command is not marked e2e but starts a process (subprocess.Popen: true)*",
        "*test_unmarked_swallows_what_the_guard_raised is not marked e2e but starts a process*",
        "*test_unmarked_starts_a_multiprocessing_process is not marked e2e but starts a multiprocessing process*",
        "*test_unmarked_starts_ray is not marked e2e but calls ray.init*",
        "*test_unmarked_loads_the_real_weights is not marked e2e but reads the real model's weights*",
        "PASSED*test_unmarked_reads_the_header_and_lets_the_stdlib_ask_the_os*",
        "PASSED*test_marked_may_start_a_process_and_load_the_weights*",
    ])
