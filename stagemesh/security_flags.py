"""``stagemesh serve``'s security flags: who may call the gateway and the stages, and over what.

One home for these flags, so ``serve.py`` only adds them (``add_arguments``) and reads their values:

- the gateway: ``--api-key`` (``STAGEMESH_API_KEY``) and ``--api-key-file`` (one key per line; both may be
  given), ``--allowed-origins`` (CORS; off by default), ``--max-request-bytes`` (413),
  ``--max-concurrent-requests`` and ``--max-concurrent-requests-per-key`` (429 with ``Retry-After``),
  ``--ssl-keyfile`` / ``--ssl-certfile`` (HTTPS, vLLM's flags);
- the control plane: ``--mesh-token`` (``STAGEMESH_MESH_TOKEN``, else generated) and ``--grpc-tls-dir``
  (``STAGEMESH_GRPC_TLS_DIR``: mutual TLS with the mesh's CA, ``stagemesh_core.grpc_tls``).

Every value is checked before anything starts; a bad one raises ``UserError`` naming the flag.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from gateway.http.api_keys import read_api_key_file
from stagemesh_core import settings
from stagemesh_core.errors import UserError
from stagemesh_core.grpc_tls import TlsFiles, read_tls_dir
from stagemesh_core.mesh_token import resolve_token


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security and limits")
    group.add_argument("--api-key-file", default=None,
                       help="accept every key in this file on /v1 and /api (one per line, # comments; with --api-key "
                            "too)")
    group.add_argument("--allowed-origins", default=None,
                       help="origins browsers may call the API from (CORS): a JSON list as vLLM takes it "
                            "('[\"https://a.example\"]') or a comma-separated list; default: none")
    group.add_argument("--max-request-bytes", type=int, default=8 * 1024 * 1024,
                       help="longer request bodies get 413 (default %(default)s; 0: no limit)")
    group.add_argument("--max-concurrent-requests", type=int, default=0,
                       help="requests in flight beyond which new ones get 429 with Retry-After (default 0: no cap)")
    group.add_argument("--max-concurrent-requests-per-key", type=int, default=0,
                       help="the same, per API key (default 0: no cap)")
    group.add_argument("--ssl-keyfile", default=None, help="serve the gateway over HTTPS with this private key")
    group.add_argument("--ssl-certfile", default=None, help="... and this certificate (chain), PEM")
    group.add_argument("--mesh-token", default=None,
                       help="secret every state-changing gRPC call to a stage must carry (default "
                            "$STAGEMESH_MESH_TOKEN, else generated at start); prefer the variable: flags show in ps")
    group.add_argument("--grpc-tls-dir", default=None,
                       help="mutual TLS for the stages' gRPC: a directory with ca.pem, node.pem, node.key "
                            "(`stagemesh certs`; default $STAGEMESH_GRPC_TLS_DIR; unset: plaintext)")


def parse_origins(raw: str | None) -> tuple[str, ...]:
    if not raw or not raw.strip():
        return ()
    text = raw.strip()
    if text.startswith("["):
        try:
            values = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UserError(f"--allowed-origins {raw!r}: not a JSON list ({exc.msg})") from None
        if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
            raise UserError(f"--allowed-origins {raw!r}: give a JSON list of strings")
    else:
        values = text.split(",")
    origins = tuple(v.strip().rstrip("/") for v in values if v.strip())
    for origin in origins:
        if origin != "*" and "://" not in origin:
            raise UserError(f"--allowed-origins: {origin!r} is not an origin; write scheme://host[:port], "
                            "e.g. http://localhost:3000, or *")
    return origins


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    keys: list[str] = []
    single = args.api_key or settings.API_KEY
    if single:
        keys.append(single)
    if args.api_key_file:
        keys += read_api_key_file(args.api_key_file)
    return tuple(dict.fromkeys(keys))


def grpc_tls(args: argparse.Namespace) -> TlsFiles | None:
    path = args.grpc_tls_dir or settings.GRPC_TLS_DIR
    if not path:
        return None
    source = "--grpc-tls-dir" if args.grpc_tls_dir else settings.env_name("GRPC_TLS_DIR")
    return read_tls_dir(os.path.abspath(os.path.expanduser(path)), source)


def mesh_token(args: argparse.Namespace) -> str:
    return resolve_token(args.mesh_token, os.environ)


def check_gateway_flags(args: argparse.Namespace) -> None:
    for flag in ("max_request_bytes", "max_concurrent_requests", "max_concurrent_requests_per_key"):
        if getattr(args, flag) < 0:
            raise UserError(f"--{flag.replace('_', '-')} must be 0 (no limit) or positive, got {getattr(args, flag)}")
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise UserError("--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile)):
        if path and not os.path.isfile(path):
            raise UserError(f"{flag} {path}: no such file")
    if args.ssl_certfile:
        import ssl

        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        except (ssl.SSLError, OSError) as exc:
            raise UserError(f"--ssl-certfile {args.ssl_certfile} / --ssl-keyfile {args.ssl_keyfile}: cannot load "
                            f"them as a PEM certificate and its key ({exc})") from None
    parse_origins(args.allowed_origins)
    api_keys(args)  # a missing or empty keys file fails now, not after the mesh has started


def gateway_options(args: argparse.Namespace) -> dict[str, Any]:
    """``GatewayConfig`` fields from the flags (the mesh token and TLS files come from the coordinator)."""
    return {
        "api_keys": api_keys(args), "allowed_origins": parse_origins(args.allowed_origins),
        "max_request_bytes": args.max_request_bytes, "max_concurrent_requests": args.max_concurrent_requests,
        "max_concurrent_requests_per_key": args.max_concurrent_requests_per_key,
    }


def uvicorn_tls(args: argparse.Namespace) -> dict[str, Any]:
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile} if args.ssl_certfile else {}


def scheme(args: argparse.Namespace) -> str:
    return "https" if args.ssl_certfile else "http"
