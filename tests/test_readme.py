"""The README's two commands are the ones CI and users run."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _readme_commands() -> list[str]:
    lines = (ROOT / "README.md").read_text().splitlines()
    return [line for line in lines if line.startswith("python3 -m venv .venv")]


def test_ci_runs_the_readme_test_command():
    serve, test = _readme_commands()
    assert serve.endswith("stagemesh serve")
    test_tail = test.split(" && ", 2)[2]  # after creating and activating the venv
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_tail in ci_lines
