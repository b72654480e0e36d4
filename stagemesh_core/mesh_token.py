"""The mesh token: the shared secret every state-changing gRPC call to a stage carries.

Contract:

- ``resolve_token(flag, env)``: ``--mesh-token``, then ``STAGEMESH_MESH_TOKEN``, else a fresh random token
  (``generate_token``); a token that cannot travel as gRPC metadata raises ``UserError`` (``check_token``).
- ``METADATA_KEY`` / ``call_metadata(token)``: the metadata a client sends (``authorization: Bearer <token>``).
- ``requires_token(method)``: default deny; only ``OPEN_METHODS`` and ``OPEN_SERVICES`` (health, reflection,
  ``GetStageInfo``, none of which changes state) are open.
- ``token_matches(metadata, expected)``: a constant-time comparison.

The token is never logged: callers keep it in fields with ``repr=False``.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Iterable, Mapping

from stagemesh_core import settings
from stagemesh_core.errors import UserError

METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
SCHEME = "Bearer "
MIN_LENGTH = 16  # a guessable token is no lock; generated ones have 43 characters

# Services whose every method stays open: health checks and `grpcurl list` need no secret.
OPEN_SERVICES = frozenset({
    "grpc.health.v1.Health",
    "grpc.reflection.v1alpha.ServerReflection",
    "grpc.reflection.v1.ServerReflection",
})
# Single open methods of guarded services: reading a stage's description changes nothing.
OPEN_METHODS = frozenset({"/stagemesh.v1.Stage/GetStageInfo"})


def generate_token() -> str:
    """A fresh random token (256 bits, URL-safe base64: printable, no spaces)."""
    return secrets.token_urlsafe(32)


def check_token(token: str, source: str) -> str:
    """``token`` if it can be a mesh token, else ``UserError`` naming ``source`` (the flag or variable)."""
    if len(token) < MIN_LENGTH:
        raise UserError(f"{source}: the mesh token must have at least {MIN_LENGTH} characters "
                        f"(got {len(token)}); make one with: "
                        "python -c 'import secrets; print(secrets.token_urlsafe(32))'")
    if not all(33 <= ord(c) <= 126 for c in token):
        raise UserError(f"{source}: the mesh token must be printable ASCII without spaces (it travels as gRPC "
                        "metadata)")
    return token


def resolve_token(flag: str | None, env: Mapping[str, str]) -> str:
    """The mesh's token: ``--mesh-token``, else ``STAGEMESH_MESH_TOKEN``, else a generated one.

    A single-machine mesh needs no setup; a cluster whose nodes start stages for one coordinator gets the
    token through each stage's ``StageLaunch``. A token that cannot travel as gRPC metadata (non-printable
    ASCII, spaces, too short) raises ``UserError``."""
    if flag:
        return check_token(flag, "--mesh-token")
    from_env = (settings.read("MESH_TOKEN", env) or "").strip()
    if from_env:
        return check_token(from_env, settings.env_name("MESH_TOKEN"))
    return generate_token()


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a client attaches to each call to a stage: ``authorization: Bearer <token>``, so
    ``grpcurl -H 'authorization: Bearer …'`` works as it does for any bearer-guarded gRPC service."""
    return ((METADATA_KEY, SCHEME + token),)


def requires_token(method: str) -> bool:
    """Whether the full method name (``/package.Service/Method``) needs the token: all but the open ones.

    Default deny: only ``OPEN_METHODS`` and ``OPEN_SERVICES`` (what probes and ``grpcurl list`` need, none of
    which changes state) are open; every other method, including any added later, needs the token."""
    if method in OPEN_METHODS:
        return False
    service = method.lstrip("/").partition("/")[0]
    return service not in OPEN_SERVICES


def token_matches(metadata: Iterable[tuple[str, str | bytes]], expected: str) -> bool:
    """Whether ``metadata`` carries ``authorization: Bearer <expected>``; constant time in the token
    (``hmac.compare_digest``), so the answer's timing says nothing about how much of a guess was right."""
    presented = b""
    for key, value in metadata:
        if key == METADATA_KEY:
            raw = value if isinstance(value, bytes) else value.encode("utf-8", "replace")
            if raw[:len(SCHEME)].lower() == SCHEME.lower().encode():
                presented = raw[len(SCHEME):].strip()
            break
    # compare_digest on equal-purpose bytes; an empty expected token never matches anything.
    return bool(expected) and hmac.compare_digest(presented, expected.encode("utf-8"))
