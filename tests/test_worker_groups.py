"""tests/worker_groups.py: the expected seconds that order the groups, and the table a run stores."""

from __future__ import annotations

import json

import pytest

from tests.worker_groups import durations_text, expected_seconds, group_durations, read_durations


def test_known_groups_scale_with_their_tests_and_unknown_ones_take_their_tiers_mean():
    table = {"slow-a": {"seconds": 100.0, "tests": 4}, "slow-b": {"seconds": 20.0, "tests": 1},
             "fast-a": {"seconds": 1.0, "tests": 10}}
    sizes = {"slow-a": 2, "slow-b": 1, "slow-new": 3, "fast-a": 10, "fast-new": 5}
    expected = expected_seconds(sizes, {"slow-a", "slow-b", "slow-new"}, table)
    assert expected == {"slow-a": 50.0, "slow-b": 20.0, "slow-new": 3 * 120.0 / 5, "fast-a": 1.0,
                        "fast-new": 5 * 0.1}


def test_without_a_table_the_order_is_the_test_count():
    assert expected_seconds({"a": 3, "b": 7}, {"a"}, {}) == {"a": 3.0, "b": 7.0}


def test_only_groups_whose_every_test_ran_are_stored():
    groups = {"f.py::a": "f.py", "f.py::b": "f.py", "g.py::c": "g.py", "shared": "s", "h.py::d": "h.py"}
    seconds = {"f.py::a": 1.25, "f.py::b": 2.0, "g.py::c": 3.0, "shared": 0.5}
    assert group_durations(groups, seconds) == {"f.py": {"seconds": 3.2, "tests": 2},
                                                "g.py": {"seconds": 3.0, "tests": 1},
                                                "s": {"seconds": 0.5, "tests": 1}}


def test_the_table_reads_back_what_was_written_and_a_bad_entry_names_the_fix(tmp_path):
    path = tmp_path / "durations.json"
    assert read_durations(path) == {}
    table = {"b": {"seconds": 2.5, "tests": 1}, "a": {"seconds": 0.0, "tests": 3}}
    path.write_text(durations_text(table))
    assert read_durations(path) == table
    assert path.read_text().splitlines()[1].startswith(' "a"')
    path.write_text(json.dumps({"a": {"seconds": 1, "tests": 0}}))
    with pytest.raises(ValueError, match="--store-group-durations"):
        read_durations(path)


def test_a_run_merges_its_groups_into_the_table_and_orders_by_it(pytester):
    pytester.makepyfile(test_quick="def test_one(): pass\ndef test_two(): pass\n",
                        test_slow="import time\ndef test_three(): time.sleep(0.2)\n")
    table = pytester.path / "durations.json"
    table.write_text(durations_text({"elsewhere.py": {"seconds": 9.0, "tests": 1}}))
    result = pytester.runpytest_inprocess("-p", "tests.worker_groups", "-n", "0", "--store-group-durations",
                                          f"--group-durations={table}")
    result.assert_outcomes(passed=3)
    stored = read_durations(table)
    assert set(stored) == {"elsewhere.py", "test_quick.py", "test_slow.py"}
    assert stored["test_quick.py"]["tests"] == 2 and stored["test_slow.py"]["seconds"] >= 0.2
    # Now test_slow.py is known to take longer than test_quick.py: it runs first.
    result = pytester.runpytest_inprocess("-p", "tests.worker_groups", "-n", "0", f"--group-durations={table}",
                                          "-v")
    lines = [line for line in result.outlines if "PASSED" in line]
    assert lines[0].startswith("test_slow.py::test_three")
