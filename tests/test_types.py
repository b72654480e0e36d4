"""The type check CI runs, enforced: ``mypy`` at the basic level configured in pyproject.toml reports no errors.

``[tool.mypy]`` in pyproject.toml names the files and the settings; this runs
``python -m mypy`` with no arguments from the repository root, as CI does, and
fails with mypy's report when it finds anything.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_reports_no_errors():
    done = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    print(done.stdout)
    assert done.returncode == 0, f"mypy failed (exit {done.returncode}):\n{done.stdout}{done.stderr}"
