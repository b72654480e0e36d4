"""docs/reference.md documents every ``stagemesh`` flag and every environment variable stagemesh reads, no more.

The flags come from the real parser (``stagemesh.cli.build_parser``, every subcommand and every nested
subparser such as ``bench compare``); the variables from ``stagemesh_core.settings.VARIABLES`` and from every
``STAGEMESH_*`` name the project's code and scripts mention. The page is read as markdown: a heading naming
``stagemesh CMD`` in backticks opens that command's section; the first cell of each table row in it names
flags (backticked option strings) or a positional (a backticked upper-case name), and its "default" cell must
show the parser's default; "Every flag of `stagemesh X`" in a section takes X's rows too. Under "## Environment
variables" the first cell of each row names a variable. Nothing runs: the parsers are only built.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stagemesh import cli
from stagemesh_core import settings

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = ROOT / "docs" / "reference.md"
PAGE = "docs/reference.md"

HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
COMMAND = re.compile(r"`stagemesh ([a-z][a-z-]*(?: [a-z][a-z-]*)*)")
INHERITS = re.compile(r"Every flag of `stagemesh ([a-z][a-z-]*(?: [a-z][a-z-]*)*)`")
SPAN = re.compile(r"`([^`]+)`")
POSITIONAL = re.compile(r"^`([A-Z][A-Z0-9_]*)`$")
VARIABLE = re.compile(r"^`(_?[A-Z][A-Z0-9_]*)`$")
CELL_BORDER = re.compile(r"(?<!\\)\|")
SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
# A STAGEMESH_* name in code: an environment variable someone reads or sets.
MENTIONED = re.compile(r"(?<![A-Za-z0-9_])_?STAGEMESH_[A-Z][A-Z0-9_]*")


@dataclass
class Section:
    rows: dict[str, str] = field(default_factory=dict)  # option string or positional name -> its default cell
    inherits: str | None = None


@dataclass
class Reference:
    commands: dict[str, Section] = field(default_factory=dict)  # "bench compare" -> its section
    variables: dict[str, str] = field(default_factory=dict)  # variable -> its default cell


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in CELL_BORDER.split(line.strip())[1:-1]]


def parse_reference(text: str) -> Reference:
    """The commands, flags and variables a reference page documents, with their default cells."""
    reference = Reference()
    section: Section | None = None
    in_variables = False
    env_level = 0
    lines = text.splitlines()
    default_column = None
    for index, line in enumerate(lines):
        heading = HEADING.match(line)
        if heading:
            level, title = len(heading.group(1)), heading.group(2)
            if in_variables and level <= env_level:
                in_variables = False
            if title == "Environment variables":
                in_variables, env_level, section = True, level, None
            elif (command := COMMAND.search(title)) and not in_variables:
                section = reference.commands.setdefault(command.group(1), Section())
            elif not in_variables:
                section = None
            continue
        if section is not None and (inherited := INHERITS.search(line)):
            section.inherits = inherited.group(1)
        if not line.lstrip().startswith("|") or SEPARATOR.match(line.strip()):
            continue
        cells = _cells(line)
        if index + 1 < len(lines) and SEPARATOR.match(lines[index + 1].strip()):  # a header row
            default_column = cells.index("default") if "default" in cells else None
            continue
        default = cells[default_column] if default_column is not None and default_column < len(cells) else ""
        first = cells[0] if cells else ""
        if in_variables:
            if variable := VARIABLE.match(first):
                reference.variables[variable.group(1)] = default
        elif section is not None:
            if positional := POSITIONAL.match(first):
                section.rows[positional.group(1)] = default
            for span in SPAN.findall(first):
                if span.startswith("-"):
                    section.rows[span.split()[0]] = default
    return reference


def commands_of(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.ArgumentParser]:
    """Every command under ``parser`` by its path ("bench compare"), nested subparsers walked."""
    found = {prefix: parser} if prefix else {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found.update(commands_of(child, f"{prefix} {name}".strip()))
    return found


def real_commands() -> dict[str, argparse.ArgumentParser]:
    """The real CLI's commands: ``build_parser`` fills in only the subcommand named, so build it for each."""
    found: dict[str, argparse.ArgumentParser] = {}
    for name in cli.SUBCOMMANDS:
        found.update({path: parser for path, parser in commands_of(cli.build_parser([name])).items()
                      if path.split()[0] == name})
    return found


def _names(action: argparse.Action) -> list[str]:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
        return []
    if action.option_strings:
        return list(action.option_strings)
    metavar = action.metavar if isinstance(action.metavar, str) else None
    return [metavar or action.dest.upper()]


def _default_problem(action: argparse.Action, cell: str) -> str | None:
    """Why ``cell`` does not show the action's default, or None when it does (or the default is free text)."""
    default = action.default
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        word = "on" if default else "off"
        return None if cell.startswith(word) else f"its default is {word}, the page says {cell!r}"
    if default is None or default == argparse.SUPPRESS or default in ("", []) or isinstance(default, bool):
        return None  # none, or a default the code works out: the page says in words
    forms = {f"`{default}`"} | ({f"`{default:g}`"} if isinstance(default, float) else set())
    return None if any(form in cell for form in forms) else f"its default is {default!r}, the page says {cell!r}"


def flag_problems(commands: dict[str, argparse.ArgumentParser], reference: Reference) -> list[str]:
    """Every flag or positional of ``commands`` the page lacks or shows another default of, every one it
    documents that no parser has, and every command without a section (or a section without a command)."""
    problems = []
    for path, parser in commands.items():
        section = reference.commands.get(path)
        if section is None:
            problems.append(f"stagemesh {path}: no section in {PAGE}")
            continue
        rows = dict(section.rows)
        if section.inherits:
            parent = reference.commands.get(section.inherits)
            if parent is None:
                problems.append(f"stagemesh {path}: takes the flags of `stagemesh {section.inherits}`, "
                                f"which has no section in {PAGE}")
            else:
                rows = {**parent.rows, **rows}
        existing: set[str] = set()
        for action in parser._actions:
            names = _names(action)
            existing.update(names)
            if not names or action.help == argparse.SUPPRESS:  # a hidden flag is for stagemesh's own children
                continue
            undocumented = [name for name in names if name not in rows]
            problems += [f"stagemesh {path}: {name} is not documented in {PAGE}" for name in undocumented]
            if not undocumented and (problem := _default_problem(action, rows[names[0]])):
                problems.append(f"stagemesh {path}: {names[0]}: {problem}")
        problems += [f"stagemesh {path}: {name} is documented in {PAGE} but the parser has no such flag"
                     for name in rows if name not in existing]
    problems += [f"stagemesh {path}: {PAGE} has a section for it, but there is no such command"
                 for path in reference.commands if path not in commands]
    return problems


def registry_defaults() -> dict[str, Any]:
    """Every variable of the settings registry with the value it has when unset."""
    return {variable.env_name: variable.read({}) for variable in settings.VARIABLES.values()}


def mentioned_variables(root: Path = ROOT) -> dict[str, str]:
    """Every ``STAGEMESH_*`` name in the project's Python and shell files (tests included, this file not),
    with one file that mentions it: the variables read or set outside the registry show up here too."""
    found: dict[str, str] = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in {"__pycache__", "node_modules"}]
        for name in files:
            path = Path(folder, name)
            if path.suffix not in {".py", ".sh"} or path == Path(__file__).resolve():
                continue
            for match in MENTIONED.findall(path.read_text(errors="replace")):
                found.setdefault(match, str(path.relative_to(root)))
    return found


def variable_problems(registry: dict[str, Any], mentioned: dict[str, str], reference: Reference) -> list[str]:
    """Every variable of the registry or of the code the page lacks (or shows another default of), and every
    one it documents that neither has."""
    problems = []
    for name, default in registry.items():
        cell = reference.variables.get(name)
        if cell is None:
            problems.append(f"{name} (stagemesh_core/settings.py) is not documented in {PAGE}")
        elif default in (None, ""):
            if not cell.startswith("unset"):
                problems.append(f"{name}: unset by default, the page says {cell!r}")
        else:
            forms = {f"`{default}`"} | ({f"`{default:g}`"} if isinstance(default, float) else set())
            if not any(form in cell for form in forms):
                problems.append(f"{name}: its default is {default!r}, the page says {cell!r}")
    problems += [f"{name} ({where}) is not documented in {PAGE}"
                 for name, where in mentioned.items() if name not in registry and name not in reference.variables]
    problems += [f"{name} is documented in {PAGE} but neither stagemesh_core/settings.py nor the code has it"
                 for name in reference.variables if name not in registry and name not in mentioned]
    return problems


def test_every_flag_is_documented_and_every_documented_flag_exists():
    problems = flag_problems(real_commands(), parse_reference(REFERENCE.read_text()))
    assert not problems, "\n".join(problems)


def test_every_environment_variable_is_documented_and_every_documented_one_exists():
    problems = variable_problems(registry_defaults(), mentioned_variables(), parse_reference(REFERENCE.read_text()))
    assert not problems, "\n".join(problems)


def test_the_walk_reaches_every_command_and_the_page_every_flag():
    # Guards against a check that passes because it reads nothing: the commands, their flags and the page's rows.
    commands = real_commands()
    assert {"serve", "chat", "status", "plan", "doctor", "convert", "certs", "soak", "bench",
            "bench serve", "bench compare", "bench parity"} <= set(commands)
    assert "--expert-parallel-size" not in {o for p in commands.values() for a in p._actions for o in a.option_strings}
    assert {"--pipeline-parallel-size", "-pp", "--speculative-config"} <= {
        o for a in commands["serve"]._actions for o in a.option_strings}
    reference = parse_reference(REFERENCE.read_text())
    assert sum(len(section.rows) for section in reference.commands.values()) > 200
    assert reference.commands["plan"].inherits == "serve"
    assert {"STAGEMESH_HOST_IP", "RAY_ADDRESS"} <= set(reference.variables)
    assert "STAGEMESH_BLAS_REEXEC" in mentioned_variables()  # read outside the registry (the stage's re-exec mark)


SYNTHETIC_PAGE = """
## `stagemesh demo [INPUT]`

| flag | value | default | meaning |
|---|---|---|---|
| `INPUT` | positional | none | what to read |
| `--kept`, `-k` | `N` | `3` | a flag both have |
| `--rate` | `X` | `0.5` | a float default |
{extra_rows}
## `stagemesh demo child`

Every flag of `stagemesh demo`, plus:

| flag | value | default | meaning |
|---|---|---|---|
| `--own` |  | off | the child's own switch |

## Environment variables

| variable | default | meaning |
|---|---|---|
| `STAGEMESH_KEPT` | `7` | in the registry |
| `STAGEMESH_UNSET` | unset | in the registry, no default |
{extra_variables}
## Afterwards

| flag | value | default | meaning |
|---|---|---|---|
| `--not-a-command-flag` | | | outside any command's section: ignored |
"""


def _synthetic_parser(*, new_flag: bool) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagemesh")
    demo = parser.add_subparsers().add_parser("demo")
    child = demo.add_subparsers().add_parser("child")
    for target in (demo, child):
        target.add_argument("input", nargs="?")
        target.add_argument("--kept", "-k", type=int, default=3)
        target.add_argument("--rate", type=float, default=0.5)
        target.add_argument("--hidden", help=argparse.SUPPRESS)
        if new_flag:
            target.add_argument("--new-flag")
    child.add_argument("--own", action="store_true")
    return parser


def test_the_flag_check_catches_a_missing_a_stale_and_a_changed_flag():
    complete = SYNTHETIC_PAGE.format(extra_rows="", extra_variables="")
    assert flag_problems(commands_of(_synthetic_parser(new_flag=False)), parse_reference(complete)) == []

    stale = SYNTHETIC_PAGE.format(extra_rows="| `--old-flag` | | none | gone from the parser |\n",
                                  extra_variables="")
    problems = flag_problems(commands_of(_synthetic_parser(new_flag=True)), parse_reference(stale))
    assert "stagemesh demo: --new-flag is not documented in docs/reference.md" in problems
    assert "stagemesh demo child: --new-flag is not documented in docs/reference.md" in problems
    assert "stagemesh demo: --old-flag is documented in docs/reference.md but the parser has no such flag" in problems
    assert "stagemesh demo child: --old-flag is documented in docs/reference.md but the parser has no such flag" \
        in problems  # inherited rows are checked against the child's parser too

    changed = complete.replace("| `3` |", "| `4` |").replace("| `--own` |  | off |", "| `--own` |  | on |")
    problems = flag_problems(commands_of(_synthetic_parser(new_flag=False)), parse_reference(changed))
    assert any(p.startswith("stagemesh demo: --kept: its default is 3") for p in problems), problems
    assert any(p.startswith("stagemesh demo child: --own: its default is off") for p in problems), problems

    no_child = complete.split("## `stagemesh demo child`")[0]
    assert "stagemesh demo child: no section in docs/reference.md" in flag_problems(
        commands_of(_synthetic_parser(new_flag=False)), parse_reference(no_child))


def test_the_variable_check_catches_a_missing_and_a_stale_variable():
    registry = {"STAGEMESH_KEPT": 7, "STAGEMESH_UNSET": None}
    complete = SYNTHETIC_PAGE.format(extra_rows="", extra_variables="")
    assert variable_problems(registry, {}, parse_reference(complete)) == []

    stale = SYNTHETIC_PAGE.format(extra_rows="", extra_variables="| `STAGEMESH_GONE` | unset | removed |\n")
    problems = variable_problems({**registry, "STAGEMESH_NEW": "auto"}, {"STAGEMESH_ELSEWHERE": "tool.sh"},
                                 parse_reference(stale))
    assert problems == [
        "STAGEMESH_NEW (stagemesh_core/settings.py) is not documented in docs/reference.md",
        "STAGEMESH_ELSEWHERE (tool.sh) is not documented in docs/reference.md",
        "STAGEMESH_GONE is documented in docs/reference.md but neither stagemesh_core/settings.py nor the code has it",
    ]
    changed = complete.replace("| `7` |", "| `8` |")
    assert variable_problems(registry, {}, parse_reference(changed)) == [
        "STAGEMESH_KEPT: its default is 7, the page says '`8`'"]
