"""How the suite spreads over pytest-xdist's workers (``-n 3 --dist loadgroup`` in pyproject's addopts).

A group of tests runs on one worker, one test after another; groups run side by side. A test's group is:

- its ``xdist_group`` mark's name, where it has one;
- ``e2e-shared-serves`` for every test using a serve the ``tests/e2e`` package shares (``SHARED_SERVES``):
  that package-scoped serve then starts once in the run, not once per worker;
- otherwise its file, so a module-scoped fixture (a serve, a loaded model) starts once.

xdist's own ``loadgroup`` cannot see the marks under pytest 9 (it renames ``item._nodeid``, which pytest 9 no
longer reads), and its scheduler sees only node ids: each worker writes the groups of the tests it collected
to a JSON file in a directory the controller names, and the controller's scheduler reads them. Groups are
handed out slow tier first, larger groups first within each tier, so the long groups start early and the quick
ones fill in at the end. Without xdist (``-n 0``) only the order applies.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

SHARED_SERVES_GROUP = "e2e-shared-serves"
_GROUPS_DIR = "stagemesh_groups_dir"  # the workerinput key naming the directory the groups are written to
_groups_dir_key = pytest.StashKey[Path]()


def group_of(item: pytest.Item) -> str:
    """The group ``item`` runs in (the module docstring's rules)."""
    from tests.e2e.conftest import SHARED_SERVES

    mark = item.get_closest_marker("xdist_group")
    if mark is not None:
        return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
    if any(name in item.fixturenames for name in SHARED_SERVES):
        return SHARED_SERVES_GROUP
    return item.nodeid.split("::")[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups = {item.nodeid: group_of(item) for item in items}
    sizes = Counter(groups.values())
    first_seen = {group: index for index, group in reversed(list(enumerate(groups.values())))}
    slow_groups = {groups[item.nodeid] for item in items if item.get_closest_marker("e2e") is not None}
    # Slow groups first, the larger first (the e2e package's shared serves are the longest); each group's tests
    # stay together and in their order.
    items.sort(key=lambda item: (groups[item.nodeid] not in slow_groups, -sizes[groups[item.nodeid]],
                                 first_seen[groups[item.nodeid]]))
    workerinput: dict[str, Any] | None = getattr(config, "workerinput", None)
    if workerinput is not None and _GROUPS_DIR in workerinput:
        path = Path(workerinput[_GROUPS_DIR]) / f"{workerinput['workerid']}.json"
        path.write_text(json.dumps(groups))


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

    return GroupScheduling(config, log)
