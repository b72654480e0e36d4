"""API keys from a file: several clients, each with its own key, revoked by deleting a line.

Contract: ``parse_api_keys(text, source)`` -> the keys, in file order, without
duplicates. One key per line; blank lines and lines starting with ``#`` are
ignored, and anything after whitespace on a key's line is a comment (a name
for whom the key is). A key must be printable ASCII without spaces (it travels
in an ``Authorization`` header). A file with no key, or a bad line, raises
``UserError`` naming the file and line (never echoing a key).
``read_api_key_file(path)`` reads and parses one.
"""

from __future__ import annotations

from stagemesh_core.errors import UserError


def parse_api_keys(text: str, source: str) -> tuple[str, ...]:
    keys: dict[str, None] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        key = stripped.split()[0]
        if not all(33 <= ord(c) <= 126 for c in key):
            raise UserError(f"{source} line {number}: an API key must be printable ASCII without spaces")
        keys[key] = None
    if not keys:
        raise UserError(f"{source} holds no API key: write one key per line (# starts a comment)")
    return tuple(keys)


def read_api_key_file(path: str) -> tuple[str, ...]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"--api-key-file {path}: cannot read it ({exc})") from None
    return parse_api_keys(text, f"--api-key-file {path}")
