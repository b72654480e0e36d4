"""The layering of docs/architecture.md, enforced: services depend only on the core, the core on nothing heavy.

Every ``import`` and ``from ... import`` in a package's source (module level or
inside a function) is read with ``ast``; a first-party import outside the
package's allowed set fails with the file, the line and the rule. A second
check imports the core in a fresh interpreter and asserts nothing heavy (MLX,
NumPy, Ray, FastAPI) came with it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = ("stagemesh", "stage_worker", "coordinator", "gateway", "deploy", "tests")

# package (a folder or file under ROOT) -> first-party modules it may import. Matches the table
# in docs/architecture.md ("The folders say the architecture").
ALLOWED: dict[str, tuple[str, ...]] = {
    "stagemesh/core": ("stagemesh.core",),
    "stage_worker": ("stage_worker", "stagemesh.core"),
    "coordinator": ("coordinator", "stagemesh.core"),
    "gateway": ("gateway", "stagemesh.core"),
    "deploy": ("stagemesh.core",),
    # the CLI sits on top: it may import every service, never the tests
    "stagemesh": ("stagemesh", "stage_worker", "coordinator", "gateway"),
}
# The core's only third-party dependencies (the generated gRPC code needs them).
CORE_THIRD_PARTY = ("google.protobuf", "grpc")
HEAVY = ("mlx", "mlx_lm", "numpy", "ray", "fastapi", "transformers", "uvicorn", "prometheus_client")


def _package_of(path: Path) -> str:
    rel = path.relative_to(ROOT).as_posix()
    return max((p for p in ALLOWED if rel == p or rel.startswith(p + "/") or rel == p + ".py"), key=len)


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: stays inside its own package
                continue
            found.append((node.lineno, node.module or ""))
    return found


def _allows(allowed: tuple[str, ...], module: str) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def _sources() -> list[Path]:
    return sorted(p for folder in ("stagemesh", "stage_worker", "coordinator", "gateway", "deploy")
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
            if top in sys.stdlib_module_names or top == "__future__" or _allows(("stagemesh.core",), module):
                continue
            if not _allows(CORE_THIRD_PARTY, module):
                violations.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not violations, "\n".join(violations)


@pytest.mark.e2e
def test_importing_the_core_loads_nothing_heavy():
    code = ("import sys, json, stagemesh.core.plan, stagemesh.core.settings, stagemesh.core.snapshots, "
            "stagemesh.core.states, stagemesh.core.v1.stage_pb2_grpc; print(json.dumps(sorted(sys.modules)))")
    loaded = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                       check=True, cwd=ROOT).stdout)
    heavy = [m for m in loaded if m.split(".")[0] in HEAVY]
    assert not heavy, heavy


@pytest.mark.parametrize("bad", ["import coordinator.mesh", "from gateway import app", "import stagemesh.serve"])
def test_the_check_catches_a_forbidden_import(tmp_path, bad):
    # The rule itself, on a file that breaks it: a stage_worker module importing another service.
    probe = tmp_path / "probe.py"
    probe.write_text(f"def f():\n    {bad}\n")
    modules = [m for _, m in _imports(probe)]
    assert modules and not all(_allows(ALLOWED["stage_worker"], m) for m in modules)
