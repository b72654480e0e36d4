"""The layering of docs/architecture.md, enforced: services depend only on the core, the core on nothing heavy.

Every ``import`` and ``from ... import`` in a package's source (module level or
inside a function) is read with ``ast``; a first-party import outside the
package's allowed set fails with the file, the line and the rule. A second
check imports the core in a fresh interpreter and asserts nothing heavy (MLX,
NumPy, Ray, FastAPI) came with it. The project's modules import each other
without a cycle (a function-level import may keep a heavy dependency lazy, never
hide a cycle), and the entry stage's scheduler reaches nothing of the runtime:
no MLX, only ``stage_worker.batch``, ``stage_worker.cache.prefix_cache`` and speculation's pure rules
(``stage_worker.speculation.rules``, ``stage_worker.speculation.ngram_proposer``).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("stagemesh", "stagemesh_core", "stage_worker", "coordinator", "gateway", "deploy", "tests")

# package (a folder or file under ROOT) -> first-party modules it may import. Matches the table
# in docs/architecture.md ("The folders say the architecture").
ALLOWED: dict[str, tuple[str, ...]] = {
    "stagemesh_core": ("stagemesh_core",),
    "stage_worker": ("stage_worker", "stagemesh_core"),
    "coordinator": ("coordinator", "stagemesh_core"),
    "gateway": ("gateway", "stagemesh_core"),  # app.py and config.py compose the rooms below
    # gateway's rooms (docs/architecture.md, "Inside the gateway"): each API a thin translation over the chat
    # core; the core and the plumbing never import an API, and no API imports another.
    "gateway/http": ("gateway.http", "stagemesh_core"),
    "gateway/mesh": ("gateway.mesh", "gateway.http", "stagemesh_core"),
    "gateway/parsing": ("gateway.parsing",),
    "gateway/chat": ("gateway.chat", "gateway.parsing", "gateway.http", "stagemesh_core"),
    "gateway/openai": ("gateway.openai", "gateway.chat", "gateway.http", "stagemesh_core"),
    "gateway/anthropic": ("gateway.anthropic", "gateway.chat", "gateway.http", "stagemesh_core"),
    "gateway/openai_responses": ("gateway.openai_responses", "gateway.chat", "gateway.http", "stagemesh_core"),
    "gateway/ollama": ("gateway.ollama", "gateway.chat", "gateway.http", "stagemesh_core"),
    "deploy": ("stagemesh_core",),
    # the CLI sits on top: it may import every service, never the tests
    "stagemesh": ("stagemesh", "stagemesh_core", "stage_worker", "coordinator", "gateway"),
}
# The core's only third-party dependencies (the generated gRPC code needs them).
CORE_THIRD_PARTY = ("google.protobuf", "grpc")
HEAVY = ("mlx", "mlx_lm", "numpy", "ray", "fastapi", "transformers", "uvicorn", "prometheus_client")


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).as_posix()
    return max((p for p in ALLOWED if rel == p or rel.startswith(p + "/") or rel == p + ".py"), key=len)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every import of ``path`` as an absolute module name (a relative one resolved against its package)."""
    tree = ast.parse(path.read_text(), str(path))
    try:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
    except ValueError:  # a probe file outside the project: no package to resolve against
        parts = [path.stem]
    package = parts if parts[-1] == "__init__" else parts[:-1]
    package = [p for p in package if p != "__init__"]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package[:len(package) - node.level + 1]
                if module:
                    found.append((node.lineno, ".".join(base + [module])))
                else:  # "from . import x": each name is a module of the package
                    found += [(node.lineno, ".".join(base + [alias.name])) for alias in node.names]
                continue
            found.append((node.lineno, module))
    return found


def _allows(allowed: tuple[str, ...], module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def _sources() -> list[Path]:
    return sorted(p for folder in ("stagemesh", "stagemesh_core", "stage_worker", "coordinator", "gateway", "deploy")
                  for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def test_every_first_party_import_follows_the_layering():
    violations = []
    for path in _sources():
        package = _package_of(path)
        for line, module in _imports(path):
            if module.split(".")[0] not in FIRST_PARTY:
                continue
            if not _allows(ALLOWED[package], module):
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}; {package}/ may import only "
                                  f"{', '.join(ALLOWED[package])}")
    assert not violations, "\n".join(violations)


def test_the_core_needs_only_the_standard_library_and_protobuf():
    violations = []
    for path in sorted((ROOT / "stagemesh" / "core").rglob("*.py")):
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__" or _allows(("stagemesh_core",), module):
                continue
            if not _allows(CORE_THIRD_PARTY, module):
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not violations, "\n".join(violations)


@pytest.mark.e2e
def test_importing_the_core_loads_nothing_heavy():
    code = ("import sys, json, stagemesh_core.plan, stagemesh_core.settings, stagemesh_core.snapshots, "
            "stagemesh_core.states, stagemesh_core.v1.stage_pb2_grpc; print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, cwd=ROOT).stdout)
    heavy = [m for m in loaded if m.split(".")[0] in HEAVY]
    assert not heavy, heavy


def test_the_check_resolves_a_relative_import_that_leaves_its_room():
    probe = ROOT / "gateway" / "anthropic" / "_probe_for_the_test.py"
    probe.write_text("from ..openai import serving\nfrom . import translate\n")
    try:
        modules = [m for _, m in _imports(probe)]
    finally:
        probe.unlink()
    assert modules == ["gateway.openai", "gateway.anthropic.translate"]
    assert not _allows(ALLOWED[_package_of(probe)], "gateway.openai")


@pytest.mark.parametrize("bad", ["import coordinator.mesh", "from gateway import app", "import stagemesh.serve"])
def test_the_check_catches_a_forbidden_import(tmp_path, bad):
    # The rule itself, on a file that breaks it: a stage_worker module importing another service.
    probe = tmp_path / "probe.py"
    probe.write_text(f"def f():\n    {bad}\n")
    modules = [m for _, m in _imports(probe)]
    assert modules and not all(_allows(ALLOWED["stage_worker"], m) for m in modules)


# -- no import cycles ------------------------------------------------------------------------------------

def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (never run)."""
    hidden = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            hidden |= {id(n) for n in ast.walk(node)}
    return hidden


def _first_party_graph() -> dict[str, set[str]]:
    """Module -> the project's modules it imports, at module level or inside a function (what runs)."""
    modules = {_module_name(p): p for p in _sources()}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        hidden = _type_checking_only(tree)
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        targets = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                targets |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                            for alias in node.names}
        graph[module] = {t for t in map(known, targets) if t is not None and t != module}
    return graph


def _cycle_through(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """A shortest import path from ``start`` back to itself, if there is one."""
    paths = {start: [start]}
    queue = [start]
    while queue:
        module = queue.pop(0)
        for target in sorted(graph.get(module, ())):
            if target == start:
                return paths[module] + [start]
            if target not in paths:
                paths[target] = paths[module] + [target]
                queue.append(target)
    return None


def test_no_module_imports_itself_back():
    """No import cycle among the project's modules, not even one a function-level import hides: a module
    needed by two others has a home of its own. Imports under ``if TYPE_CHECKING:`` never run and do not
    count; a function-level import that keeps a heavy dependency lazy is fine as long as it closes no cycle."""
    graph = _first_party_graph()
    cycles: dict[frozenset[str], str] = {}
    for module in sorted(graph):
        if (cycle := _cycle_through(graph, module)) is not None:
            cycles.setdefault(frozenset(cycle), " -> ".join(cycle))
    assert not cycles, "\n".join(sorted(cycles.values()))


def test_the_cycle_check_sees_a_cycle_a_function_level_import_hides(tmp_path, monkeypatch):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycle_through(graph, "a") == ["a", "b", "c", "a"] and _cycle_through(graph, "d") is None
    package = tmp_path / "gateway"
    package.mkdir()
    (package / "one.py").write_text("from gateway.two import x\n")
    (package / "two.py").write_text("def x():\n    from . import one\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = _first_party_graph()
    assert _cycle_through(graph, "gateway.one") == ["gateway.one", "gateway.two", "gateway.one"]


# -- stage_worker's rooms ----------------------------------------------------------------------------------

# Room -> the rooms it may import, bottom to top (docs/architecture.md, "Inside a stage"). ``batch`` is the
# messages every room speaks; ``__main__`` and the rooms' own modules are the only other inhabitants.
STAGE_ROOMS: dict[str, tuple[str, ...]] = {
    "batch": (),
    "checkpoint": (),
    "cache": ("batch",),
    "transport": ("batch",),
    "parallel": ("batch", "checkpoint"),
    "model": ("batch", "checkpoint", "cache", "parallel"),
    "speculation": ("batch", "checkpoint", "cache", "parallel", "model"),
    "sampling": ("batch", "checkpoint", "speculation"),
    "engine": ("batch", "checkpoint", "cache", "transport", "parallel", "model", "speculation", "sampling"),
    "service": ("batch", "checkpoint", "cache", "transport", "parallel", "model", "speculation", "sampling", "engine"),
    "__main__": ("model", "service"),
}
MAX_ROOM_MODULES = 12  # a room a newcomer reads in one look; a format's own folder (checkpoint/gguf/) counts apart


def _stage_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "stage_worker" and len(parts) > 1 else None


def test_stage_worker_rooms_import_only_the_rooms_below():
    graph = _first_party_graph()
    violations = []
    for module, targets in sorted(graph.items()):
        room = _stage_room(module)
        if module.startswith("stage_worker.") and room not in STAGE_ROOMS:
            violations.append(f"{module} lives in no room of STAGE_ROOMS: move it into one")
            continue
        for target in sorted(targets):
            other = _stage_room(target)
            if room and other and other != room and other not in STAGE_ROOMS[room]:
                violations.append(f"{module} imports {target}; stage_worker/{room}/ may import only "
                                  f"{', '.join(STAGE_ROOMS[room]) or 'stagemesh_core'}")
    assert not violations, "\n".join(violations)


def test_every_stage_worker_room_states_its_contract_and_stays_small():
    for folder in sorted(p for p in (ROOT / "stage_worker").rglob("__init__.py") if p.parent != ROOT / "stage_worker"):
        assert ast.get_docstring(ast.parse(folder.read_text())), f"{folder.relative_to(ROOT)} has no contract"
        # the docstring is the whole file: importing a pure module of a room must not bring the room's MLX
        assert len(ast.parse(folder.read_text()).body) == 1, f"{folder.relative_to(ROOT)} holds more than a docstring"
        modules = [p for p in folder.parent.glob("*.py") if p.name != "__init__.py"]
        assert len(modules) <= MAX_ROOM_MODULES, f"{folder.parent.relative_to(ROOT)} holds {len(modules)} modules"


def test_the_room_check_sees_an_upward_import():
    assert _stage_room("stage_worker.cache.kv_store") == "cache" and "engine" not in STAGE_ROOMS["cache"]
    assert "service" not in STAGE_ROOMS["engine"] and "engine" in STAGE_ROOMS["service"]


# -- the scheduler is pure ---------------------------------------------------------------------------------

# The stage_worker modules the entry stage's scheduler may import: plain values and bookkeeping, no runtime.
SCHEDULER_MAY_IMPORT = ("stage_worker.batch", "stage_worker.cache.prefix_cache", "stage_worker.speculation.rules",
                        "stage_worker.speculation.ngram_proposer")


def test_the_scheduler_imports_nothing_of_the_runtime():
    graph = _first_party_graph()
    reached, queue = set(), ["stage_worker.engine.scheduler"]
    while queue:
        for target in graph[queue.pop()]:
            if target not in reached:
                reached.add(target)
                queue.append(target)
    runtime = sorted(m for m in reached if m.startswith("stage_worker.") and m not in SCHEDULER_MAY_IMPORT)
    assert not runtime, f"stage_worker/engine/scheduler.py reaches {runtime}; pass what it needs in instead"


@pytest.mark.e2e  # a fresh interpreter: a process
def test_importing_the_scheduler_loads_no_mlx():
    code = "import sys, json, stage_worker.engine.scheduler; print(json.dumps(sorted(sys.modules)))"
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, cwd=ROOT).stdout)
    assert not [m for m in loaded if m.split(".")[0] in ("mlx", "mlx_lm", "numpy")]
    rooms = {f"stage_worker.{room}" for room in STAGE_ROOMS}  # their __init__ is a docstring (checked above)
    assert not [m for m in loaded if m.startswith("stage_worker.") and m not in
                ("stage_worker.engine.scheduler", *SCHEDULER_MAY_IMPORT, *rooms)]
