"""``stagemesh certs DIR --node NAME=ADDR[,ADDR...] ...``: a mesh CA and one certificate per node.

Writes (keys 0600, never overwriting an existing CA unless asked)::

    DIR/ca.pem  DIR/ca.key           the mesh's CA; keep ca.key on one machine, off the mesh
    DIR/NAME/ca.pem  node.pem  node.key   copy this directory to node NAME, pass it as --grpc-tls-dir

Each node certificate names its addresses (IPs and DNS names, plus 127.0.0.1 and localhost, which the gateway
uses to reach the stages beside it) and is good for server and client authentication, since a node's gateway
and coordinator call the other nodes' stages with it. With an existing ``DIR/ca.pem`` and ``ca.key``, new
nodes are signed by that CA. ECDSA P-256 keys; ``--days`` validity (default 825, what Apple's TLS rules
accept for server certificates).

The pure part, ``make_ca`` / ``make_node_cert``, returns PEM bytes; ``run`` writes files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from stagemesh_core.errors import UserError
from stagemesh_core.grpc_tls import CA_FILE, CERT_FILE, KEY_FILE

CA_KEY_FILE = "ca.key"
DEFAULT_DAYS = 825
_ALWAYS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class NodeSpec:
    name: str
    addresses: tuple[str, ...]  # IPs and DNS names


def parse_node(text: str) -> NodeSpec:
    """``mac-a=169.254.10.1,mac-a.local`` -> NodeSpec; a bare name means only loopback."""
    name, _, rest = text.partition("=")
    name = name.strip()
    if not name or "/" in name or name.startswith("."):
        raise UserError(f"--node {text!r}: give NAME=ADDRESS[,ADDRESS...], e.g. mac-a=169.254.10.1")
    addresses = tuple(a.strip() for a in rest.split(",") if a.strip())
    return NodeSpec(name, addresses)


def _is_ip(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
        return True
    except ValueError:
        return False


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(common_name: str = "stagemesh mesh CA", days: int = 3650) -> tuple[bytes, bytes]:
    """(ca.pem, ca.key) of a new self-signed CA."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def make_node_cert(ca_pem: bytes, ca_key_pem: bytes, node: NodeSpec, days: int = DEFAULT_DAYS,
                   not_before: dt.datetime | None = None) -> tuple[bytes, bytes]:
    """(node.pem, node.key) for ``node``, signed by the CA; names its addresses plus loopback."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    ca_cert = x509.load_pem_x509_certificate(ca_pem)
    ca_key = serialization.load_pem_private_key(ca_key_pem, password=None)
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    for address in dict.fromkeys((*node.addresses, *_ALWAYS)):
        names.append(x509.IPAddress(ipaddress.ip_address(address)) if _is_ip(address) else x509.DNSName(address))
    start = not_before or dt.datetime.now(dt.UTC) - dt.timedelta(minutes=5)
    cert = (x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, node.name)]))
            .issuer_name(ca_cert.subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(start + dt.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()),  # type: ignore[arg-type]
                           critical=False)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def _write(path: Path, data: bytes, secret: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if secret else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    if secret:
        os.chmod(path, 0o600)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", help="where the CA and one sub-directory per node are written")
    parser.add_argument("--node", action="append", default=[], metavar="NAME=ADDR[,ADDR...]",
                        help="a node and the addresses its stages advertise (repeat per node), e.g. "
                             "--node mac-a=169.254.10.1 --node mac-b=169.254.10.2")
    parser.add_argument("--days", type=int, default=DEFAULT_DAYS, help="node certificates' validity in days")
    parser.add_argument("--new-ca", action="store_true", help="replace an existing CA (every node then needs new "
                                                              "certificates)")


def run(args: argparse.Namespace) -> int:
    if not args.node:
        raise UserError("give at least one --node NAME=ADDRESS (one per Mac of the mesh)")
    if args.days < 1:
        raise UserError(f"--days must be at least 1, got {args.days}")
    nodes = [parse_node(n) for n in args.node]
    root = Path(args.directory).expanduser()
    ca_path, ca_key_path = root / CA_FILE, root / CA_KEY_FILE
    if ca_path.exists() and ca_key_path.exists() and not args.new_ca:
        ca_pem, ca_key = ca_path.read_bytes(), ca_key_path.read_bytes()
        print(f"signing with the existing CA {ca_path}")
    else:
        ca_pem, ca_key = make_ca()
        _write(ca_path, ca_pem, secret=False)
        _write(ca_key_path, ca_key, secret=True)
        print(f"new mesh CA: {ca_path} (keep {ca_key_path} private and off the mesh)")
    for node in nodes:
        cert, key = make_node_cert(ca_pem, ca_key, node, args.days)
        folder = root / node.name
        _write(folder / CA_FILE, ca_pem, secret=False)
        _write(folder / CERT_FILE, cert, secret=False)
        _write(folder / KEY_FILE, key, secret=True)
        print(f"{node.name}: {folder}/ (names {', '.join(dict.fromkeys((*node.addresses, *_ALWAYS)))}); copy it to "
              f"{node.name} and serve with --grpc-tls-dir there")
    return 0
