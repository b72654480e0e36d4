"""How the suite spreads over pytest-xdist's workers (``-n 2 --dist loadgroup`` in pyproject's addopts).

A group of tests runs on one worker, one test after another; groups run side by side. A test's group is:

- its ``xdist_group`` mark's name, where it has one;
- ``e2e-shared-serves`` for every test using a serve the ``tests/e2e`` package shares (``SHARED_SERVES``):
  that package-scoped serve then starts once in the run, not once per worker;
- otherwise its file, so a module-scoped fixture (a serve, a loaded model) starts once.

xdist's own ``loadgroup`` cannot see the marks under pytest 9 (it renames ``item._nodeid``, which pytest 9 no
longer reads), and its scheduler sees only node ids: each worker writes the groups of the tests it collected
to a JSON file in a directory the controller names, and the controller's scheduler reads them.

Groups are handed out longest expected first (LPT), so the long groups start early and the quick ones fill in at
the end. A group's expected seconds come from ``tests/group_durations.json`` (scaled to the number of its tests
collected now); a group the table does not know is expected to take its test count times the table's mean
seconds per test of its tier (``e2e`` or not). A stale table costs balance, never correctness.
``python -m pytest --store-group-durations`` (the whole suite, or the files whose groups changed) merges the
run's seconds per group into the table, every phase of every test included; only groups all of whose tests ran.
Without xdist (``-n 0``) only the order applies.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

SHARED_SERVES_GROUP = "e2e-shared-serves"
DURATIONS_PATH = Path(__file__).with_name("group_durations.json")
_GROUPS_DIR = "stagemesh_groups_dir"  # the workerinput key naming the directory the groups are written to
_groups_dir_key = pytest.StashKey[Path]()
_groups_key = pytest.StashKey[dict[str, str]]()  # node id -> group, this process's collection
_seconds_key = pytest.StashKey[defaultdict[str, float]]()  # node id -> seconds of its phases, this run


def group_of(item: pytest.Item) -> str:
    """The group ``item`` runs in (the module docstring's rules)."""
    from tests.e2e.conftest import SHARED_SERVES

    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    if any(name in item.fixturenames for name in SHARED_SERVES):
        return SHARED_SERVES_GROUP
    return item.nodeid.split("::")[0]


def read_durations(path: Path = DURATIONS_PATH) -> dict[str, dict[str, float]]:
    """The table of measured groups: ``{group: {"seconds": s, "tests": n}}``; empty where there is none."""
    if not path.exists():
        return {}
    table = json.loads(path.read_text())
    for group, entry in table.items():
        if not (isinstance(entry, dict) and entry.get("seconds", -1) >= 0 and entry.get("tests", 0) > 0):
            raise ValueError(f"{path}: group {group!r} needs seconds >= 0 and tests > 0, not {entry!r}; "
                             "rewrite the table with `python -m pytest --store-group-durations`")
    return table


def expected_seconds(sizes: Mapping[str, int], slow_groups: set[str],
                     table: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """Each group's expected seconds: the table's, scaled to the tests collected now, else its test count times
    the mean seconds per test of the known groups of its tier (times 1 where its tier has none: count order)."""
    def per_test(entry: Mapping[str, float]) -> float:
        return entry["seconds"] / entry["tests"]

    mean: dict[bool, float] = {}
    for slow in (True, False):
        known = [table[g] for g in sizes if g in table and (g in slow_groups) == slow]
        tests = sum(entry["tests"] for entry in known)
        mean[slow] = sum(entry["seconds"] for entry in known) / tests if tests else 1.0
    return {group: count * (per_test(table[group]) if group in table else mean[group in slow_groups])
            for group, count in sizes.items()}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--store-group-durations", action="store_true",
                     help="merge each group's seconds in this run into the --group-durations table "
                          "(tests/worker_groups.py hands out the longest groups first)")
    parser.addoption("--group-durations", type=Path, default=DURATIONS_PATH,
                     help="the table of measured group seconds (default: tests/group_durations.json)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {item.nodeid: group_of(item) for item in items}
    config.stash[_groups_key] = groups
    sizes = Counter(groups.values())
    first_seen = {group: index for index, group in reversed(list(enumerate(groups.values())))}
    slow_groups = {groups[item.nodeid] for item in items if item.get_closest_marker("e2e") is not None}
    expected = expected_seconds(sizes, slow_groups, read_durations(config.getoption("--group-durations")))
    # The longest expected first; each group's tests stay together and in their order.
    items.sort(key=lambda item: (-expected[groups[item.nodeid]], first_seen[groups[item.nodeid]]))
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None and _GROUPS_DIR in workerinput:
        path = Path(workerinput[_GROUPS_DIR]) / f"{workerinput['workerid']}.json"
        path.write_text(json.dumps(groups))


def pytest_configure(config: pytest.Config) -> None:
    # Under xdist only the controller sees every worker's reports; a worker stores nothing.
    if config.getoption("--store-group-durations") and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_DurationsRecorder(config), "stagemesh-group-durations")


class _DurationsRecorder:
    """Sums each test's phases in the run, and merges each group's total into the table at the end."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[report.nodeid] += report.duration

    @pytest.hookimpl(tryfirst=True)  # before pytest_unconfigure removes the workers' group files
    def pytest_sessionfinish(self) -> None:
        groups = self.config.stash.get(_groups_key, None)
        if _groups_dir_key in self.config.stash:  # the controller under xdist: the groups its workers wrote
            written = sorted(self.config.stash[_groups_dir_key].glob("*.json"))
            groups = json.loads(written[0].read_text()) if written else None
        if not groups:
            return
        path: Path = self.config.getoption("--group-durations")
        table = read_durations(path)
        table.update(group_durations(groups, self.seconds))
        path.write_text(durations_text(table))


def durations_text(table: Mapping[str, Mapping[str, float]]) -> str:
    """The table as JSON, one group a line (a refreshed table reads as a short diff)."""
    lines = [f" {json.dumps(group)}: {json.dumps(dict(entry))}" for group, entry in sorted(table.items())]
    return "{\n" + ",\n".join(lines) + "\n}\n"


def group_durations(groups: Mapping[str, str], seconds: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """Seconds and test count of each group all of whose tests ran (a group cut short would read too quick)."""
    totals: defaultdict[str, float] = defaultdict(float)
    ran: Counter[str] = Counter()
    for nodeid, group in groups.items():
        if nodeid in seconds:
            totals[group] += seconds[nodeid]
            ran[group] += 1
    sizes = Counter(groups.values())
    return {group: {"seconds": round(totals[group], 1), "tests": ran[group]}
            for group in totals if ran[group] == sizes[group]}


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """Controller side, per worker: where it writes its groups (one directory for the run)."""
    config: pytest.Config = node.config
    if _groups_dir_key not in config.stash:
        config.stash[_groups_dir_key] = Path(tempfile.mkdtemp(prefix="stagemesh-xdist-groups-"))
    node.workerinput[_GROUPS_DIR] = str(config.stash[_groups_dir_key])


def pytest_unconfigure(config: pytest.Config) -> None:
    if _groups_dir_key in config.stash:
        shutil.rmtree(config.stash[_groups_dir_key], ignore_errors=True)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getvalue("dist") != "loadgroup":
        return None  # another --dist: xdist's own scheduler
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's scope scheduling with the scopes the workers wrote (``group_of``), in collection order."""

        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            super().__init__(config, log)
            self._groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._groups is None:
                # Every worker collected the same tests (xdist checks), so any one file will do; schedule()
                # runs only once all of them finished collecting, after they wrote their files.
                written = sorted(config.stash[_groups_dir_key].glob("*.json"))
                if not written:
                    raise RuntimeError("no pytest-xdist worker wrote its test groups (tests/worker_groups.py)")
                self._groups = json.loads(written[0].read_text())
            return self._groups[nodeid]

        def _reschedule(self, node: Any) -> None:
            # xdist gives a worker its next group once two of its tests are left; a worker needs only the next
            # test to run its last one, so the next group is chosen one test later, with more of them finished:
            # the longest groups left then go to the workers that free up first.
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return GroupScheduling(config, log)
