"""``stagemesh serve``'s security flags: parsed and checked before anything starts, each bad value a
one-line error naming the flag (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stagemesh.cli import main
from stagemesh.security_flags import parse_origins
from stagemesh_core.errors import UserError


def test_allowed_origins_take_vllms_json_list_or_a_comma_list():
    assert parse_origins(None) == () and parse_origins("") == ()
    assert parse_origins('["https://a.example", "http://localhost:3000/"]') == (
        "https://a.example", "http://localhost:3000")
    assert parse_origins("https://a.example, *") == ("https://a.example", "*")
    with pytest.raises(UserError, match="not an origin"):
        parse_origins("a.example")
    with pytest.raises(UserError, match="JSON list"):
        parse_origins('["https://a.example"')


BAD_FLAGS = [
    (["--ssl-keyfile", "/nonexistent.key"], "--ssl-keyfile and --ssl-certfile go together"),
    (["--ssl-keyfile", "/nonexistent.key", "--ssl-certfile", "/nonexistent.pem"], "--ssl-keyfile /nonexistent.key"),
    (["--api-key-file", "/nonexistent-keys"], "--api-key-file /nonexistent-keys"),
    (["--max-request-bytes", "-1"], "--max-request-bytes must be 0"),
    (["--allowed-origins", "nohost"], "--allowed-origins"),
    (["--grpc-tls-dir", "/nonexistent-tls"], "cannot read ca.pem"),
    (["--mesh-token", "short"], "--mesh-token"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS)
def test_a_bad_security_flag_is_a_usage_error_naming_it(flags, message, capsys):
    # The CLI's own entry point in this process; --dry-run, so a check that wrongly passed would print a plan
    # and return 0 rather than start anything. The process, its exit status and Ray's absence: the next test.
    assert main(["serve", "--port", "1", "--dry-run", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.e2e
def test_a_bad_security_flag_exits_2_before_anything_starts():
    flags, message = BAD_FLAGS[0]
    done = subprocess.run([sys.executable, "-m", "stagemesh.cli", "serve", "--port", "1", *flags],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert "ray" not in done.stderr.lower()
