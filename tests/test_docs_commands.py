"""Every ``stagemesh`` command line in README.md and docs/*.md parses with the real CLI.

The lines come from fenced code blocks and inline code (backslash continuations
joined), are split as a shell splits them (``shlex``: quotes, ``#`` comments,
``&&``, ``|``, ``&``), and each ``stagemesh ...`` or ``python -m stagemesh...``
command among them goes to ``stagemesh.cli.build_parser(argv).parse_args(argv)``
with abbreviated flags refused, as a renamed or removed flag would be by a user
who copies the whole name. Nothing runs: only the parsers are built.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from stagemesh import cli
from stagemesh.bench.command import KINDS

ROOT = Path(__file__).resolve().parent.parent
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

# Command lines written as usage synopses, with placeholders argparse cannot take as values
# (an int flag given N, a literal "..." or "[--flag VALUE]"). Each must still occur in the docs.
SYNOPSES = {
    "stagemesh plan [MODEL] -pp N ...",  # reference.md: -pp takes an int
    "stagemesh certs DIR --node NAME=ADDR ...",  # reference.md: "..." is one more positional
    "stagemesh bench KIND",  # reference.md: KIND names the kinds listed after it
    "stagemesh bench parity -pp N",  # architecture.md, distributed.md, performance.md: any N
    "stagemesh status --watch [--url http://127.0.0.1:8000] [--interval 1] [--api-key KEY] [--count N]",  # api.md
}

SEPARATORS = {"&&", "||", "|", ";", "&", "(", ")"}
ENV_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")
FENCE = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"(?<!`)`([^`]+)`(?!`)")


@dataclass(frozen=True)
class CommandLine:
    where: str  # file:line
    text: str  # the command as written, continuations joined
    argv: tuple[str, ...]  # what follows ``stagemesh``
    name_only: bool  # inline prose naming a command ("`stagemesh certs` makes..."), not a command line


def _snippets(text: str) -> list[tuple[int, str, bool]]:
    """(line number, text, inline) of every fenced block's lines and every inline code span."""
    found: list[tuple[int, str, bool]] = []
    blanked = text
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        body = block.group(1)
        start = 0
        # A console transcript ("$ " before each command) shows output too: only its "$ " lines are commands.
        transcript = any(line.lstrip().startswith("$ ") for line in body.split("\n"))
        for lineno, line in enumerate(body.split("\n"), first):
            if transcript and start == 0 and not line.lstrip().startswith("$ "):
                continue
            if start == 0:
                start, pending = lineno, ""
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            found.append((start, pending + line, False))
            start = 0
        blanked = blanked[:block.start()] + re.sub(r"[^\n]", " ", block.group(0)) + blanked[block.end():]
    for span in INLINE.finditer(blanked):
        found.append((blanked.count("\n", 0, span.start()) + 1, " ".join(span.group(1).split()), True))
    return found


def _stagemesh_argv(words: list[str]) -> tuple[str, ...] | None:
    """The arguments after ``stagemesh`` (or ``python -m stagemesh[.cli|.X]``) in one shell command."""
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words[:1] == ["$"]:  # a prompt
        words = words[1:]
    if words[:1] == ["stagemesh"]:
        return tuple(words[1:])
    if len(words) >= 3 and words[0] in ("python", "python3") and words[1] == "-m" and words[2].startswith("stagemesh"):
        module = words[2]
        if module in ("stagemesh", "stagemesh.cli"):
            return tuple(words[3:])
        for name, (command_module, _) in cli.SUBCOMMANDS.items():
            if command_module == module or command_module.startswith(module + "."):
                return (name, *words[3:])
        return (f"<no stagemesh command runs as python -m {module}>",)
    return None


def _names_a_command(argv: tuple[str, ...]) -> bool:
    return len(argv) == 1 or (len(argv) == 2 and argv[0] == "bench")


def commands_in(path: Path) -> list[CommandLine]:
    commands = []
    for lineno, snippet, inline in _snippets(path.read_text()):
        if "stagemesh" not in snippet:
            continue
        where = f"{path.relative_to(ROOT)}:{lineno}"
        lexer = shlex.shlex(snippet.strip(), posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        try:
            words = list(lexer)
        except ValueError:  # unbalanced quotes: prose, not a command line
            continue
        command: list[str] = []
        for word in [*words, ";"]:
            if word not in SEPARATORS:
                command.append(word)
                continue
            argv = _stagemesh_argv(command) if command else None
            if argv:  # () is the command's name alone, in prose
                text = " ".join(snippet.split())
                commands.append(CommandLine(where, text, argv, inline and _names_a_command(argv)))
            command = []
    return commands


ALL = [c for path in DOCS for c in commands_in(path)]


def _refusing_abbreviations(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _refusing_abbreviations(child)


def parse_error(argv: tuple[str, ...]) -> str | None:
    """argparse's message when ``stagemesh ARGV`` does not parse, else None."""
    parser = cli.build_parser(list(argv))
    _refusing_abbreviations(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(list(argv))
    except SystemExit as exit_:
        if exit_.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


@pytest.mark.parametrize("command", [c for c in ALL if c.text not in SYNOPSES and not c.name_only],
                         ids=lambda c: c.where)
def test_the_command_line_parses(command):
    assert parse_error(command.argv) is None, f"{command.where}: {command.text}"


def test_every_command_named_in_prose_exists():
    for command in (c for c in ALL if c.name_only and c.text not in SYNOPSES):
        assert command.argv[0] in cli.SUBCOMMANDS, f"{command.where}: {command.text}"
        if command.argv[0] == "bench":
            assert command.argv[1:] in {(), *((kind,) for kind in KINDS)}, f"{command.where}: {command.text}"


def test_every_doc_shows_commands_and_every_synopsis_is_still_there():
    files_with_commands = {c.where.split(":")[0] for c in ALL}
    assert files_with_commands >= {"README.md", "docs/performance.md", "docs/reliability.md"}
    assert SYNOPSES <= {c.text for c in ALL}


def test_every_bench_kind_appears_and_a_renamed_flag_is_caught():
    kinds = {c.argv[1] for c in ALL if c.argv[:1] == ("bench",) and len(c.argv) > 1}
    assert {"serve", "compare", "stack", "gateway", "engine", "pipeline", "hop", "parity"} <= kinds
    # What the test stands for: an abbreviation of the new name or an old name is an error.
    assert "unrecognized arguments: --port" in (parse_error(("bench", "stack", "--port", "9000")) or "")
    assert "unrecognized arguments: --tokens" in (parse_error(("bench", "engine", "--tokens", "8")) or "")
