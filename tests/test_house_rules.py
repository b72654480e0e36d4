"""The project's writing rules, checked on the source: a module docstring states its module's contract in a few
lines, with no measurements (they live in docs/performance.md, dated), and no text narrates how work went."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "deploy", "gateway", "proto", "stage_worker", "stagemesh", "stagemesh_core")
GENERATED = ROOT / "stagemesh_core" / "v1"  # protoc's output (proto/generate.py)
MAX_DOCSTRING_LINES = 15

# A figure with a unit of speed, time or size, a ratio, a run's date or a GPU's name: what a measurement looks like.
MEASUREMENT = re.compile(r"\b\d+(?:\.\d+)?\s*(?:ms|µs|us|tok/s|tokens/s|[KMG]B/s|x)\b|\b20\d\d-\d\d-\d\d\b|\bH[12]00\b")
# Phrases that tell the story of the work rather than describe the product.
NARRATION = re.compile(r"this session|previous session|last session|this time\b|we tried|earlier run|GPU session",
                       re.IGNORECASE)


def project_modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
                  if GENERATED not in path.parents)


def project_texts() -> list[Path]:
    """The project's code, docs, scripts and settings: every such file outside hidden and generated folders
    (pruned as the walk goes, so the virtual environment is never read)."""
    found = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in {"__pycache__", "node_modules"}]
        found += [Path(folder, name) for name in files if Path(name).suffix in {".py", ".md", ".sh", ".toml"}]
    return sorted(found)


def module_docstring(path: Path) -> str | None:
    return ast.get_docstring(ast.parse(path.read_text()), clean=False)


def test_every_module_states_its_contract_in_a_few_lines() -> None:
    modules = project_modules()
    assert len(modules) > 150, "the project's packages moved: update PACKAGES"
    missing = [str(path.relative_to(ROOT)) for path in modules if module_docstring(path) is None]
    long = {str(path.relative_to(ROOT)): lines for path in modules
            if (lines := len((module_docstring(path) or "").strip().splitlines())) > MAX_DOCSTRING_LINES}
    assert not missing, f"modules without a docstring stating their contract: {missing}"
    assert not long, (f"module docstrings over {MAX_DOCSTRING_LINES} lines (lines each): {long}; keep the contract "
                      "there and move detail to the docstring of the class or function it explains")


def test_no_module_docstring_carries_a_measurement() -> None:
    found = {str(path.relative_to(ROOT)): match.group(0) for path in project_modules()
             for match in [MEASUREMENT.search(module_docstring(path) or "")] if match}
    assert not found, f"measurements in module docstrings (they belong in docs/performance.md, dated): {found}"


def test_no_text_narrates_the_work() -> None:
    found = [f"{path.relative_to(ROOT)}: {match.group(0)!r}" for path in project_texts()
             if path != Path(__file__).resolve()
             for match in [NARRATION.search(path.read_text(errors="replace"))] if match]
    assert not found, f"text narrating how work went (date a figure instead): {found}"


def test_the_measurement_pattern_recognises_figures() -> None:
    # The checks above pass vacuously if the pattern matches nothing: pin what it must catch and must let be.
    assert MEASUREMENT.search("a step takes 12 ms on the CPU")
    assert MEASUREMENT.search("1.5x faster at 16 streams")
    assert MEASUREMENT.search("measured on 2026-12-04")
    assert MEASUREMENT.search("235 tok/s")
    assert not MEASUREMENT.search("PP=2 holds 16 layers on each of 2 stages")
    assert NARRATION.search("This time the run passed")
    assert not NARRATION.search("the time a step takes")
