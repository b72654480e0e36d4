"""Mutual TLS for the gRPC control plane: one directory per node, one home for its file names.

A node's TLS directory (``--grpc-tls-dir`` / ``STAGEMESH_GRPC_TLS_DIR``) holds ``ca.pem`` (the mesh's CA, the
same file on every node), ``node.pem`` (this node's certificate, signed by that CA, naming the addresses its
stages advertise and good for both server and client authentication) and ``node.key`` (its private key, mode
0600). ``stagemesh certs`` makes them; ``stagemesh doctor`` checks them.

Contract: ``read_tls_dir(path)`` -> ``TlsFiles`` (the key is never in a repr) or ``UserError`` naming the
file; ``server_credentials`` (a stage's port: callers must present a certificate signed by ``ca.pem``);
``channel_credentials`` (the gateway's and coordinator's channels); ``open_channel`` / ``open_aio_channel``: a
secure channel when files are given, else an insecure one (TLS is optional, the mesh token guards the calls
either way).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from stagemesh_core.errors import UserError

CA_FILE = "ca.pem"
CERT_FILE = "node.pem"
KEY_FILE = "node.key"


@dataclass(frozen=True)
class TlsFiles:
    directory: str
    ca: bytes
    cert: bytes
    key: bytes = field(repr=False)


def read_tls_dir(path: str, source: str = "--grpc-tls-dir") -> TlsFiles:
    """The three files' bytes, or ``UserError`` naming ``source`` and the missing or unreadable file."""
    directory = Path(path).expanduser()
    contents = []
    for name in (CA_FILE, CERT_FILE, KEY_FILE):
        try:
            contents.append((directory / name).read_bytes())
        except OSError as exc:
            raise UserError(f"{source} {path}: cannot read {name} ({exc.strerror or exc}); make the mesh's "
                            "certificates with `stagemesh certs` and copy each node's directory to it") from None
    ca, cert, key = contents
    return TlsFiles(str(directory), ca, cert, key)


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """A stage's port: it requires a client certificate signed by ``ca.pem`` (``require_client_auth``), so a
    caller without one (or with one from another CA) cannot even open a call."""
    return grpc.ssl_server_credentials([(files.key, files.cert)], root_certificates=files.ca,
                                       require_client_auth=True)


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """The gateway's and coordinator's channels: they verify the stage's certificate against ``ca.pem`` and
    present ``node.pem``."""
    return grpc.ssl_channel_credentials(root_certificates=files.ca, private_key=files.key,
                                        certificate_chain=files.cert)


def open_channel(target: str, files: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    if files is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, channel_credentials(files), options=list(options))


def open_aio_channel(target: str, files: TlsFiles | None, options: Sequence[tuple[str, Any]] = ()) -> Any:
    import grpc.aio

    if files is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, channel_credentials(files), options=list(options))
