"""``stagemesh doctor``'s checks of a node's mesh TLS directory (``--grpc-tls-dir``).

``check_tls(files, host_ip=..., key_mode=..., now=...)`` is pure over the files'
bytes: the CA is a CA; the node certificate is signed by that CA, matches its
key, is valid now (a warning within ``EXPIRY_WARNING_DAYS`` of its end), serves
both as server and client certificate, and names the address this node's
stages advertise (``STAGEMESH_HOST_IP``) or, without one, loopback; the key is
readable by its owner only. Each finding says how to fix it
(``stagemesh certs``). ``check_tls_dir(path, ...)`` reads the directory first.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import stat

from stagemesh.doctor.checks import ERROR, OK, WARNING, Finding
from stagemesh_core.grpc_tls import CERT_FILE, KEY_FILE, TlsFiles, read_tls_dir

EXPIRY_WARNING_DAYS = 30
CHECK = "grpc-tls"
_REMAKE = "make new ones: stagemesh certs DIR --node NAME=ADDRESS (signed by the mesh's CA) and copy NAME/ here"


def _finding(severity: str, problem: str, fix: str = "") -> Finding:
    return Finding(CHECK, severity, "", problem, fix)


def check_tls(files: TlsFiles, *, host_ip: str | None, key_mode: int | None, now: dt.datetime) -> list[Finding]:
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    where = files.directory
    try:
        ca = x509.load_pem_x509_certificate(files.ca)
        cert = x509.load_pem_x509_certificate(files.cert)
        key = serialization.load_pem_private_key(files.key, password=None)
    except ValueError as exc:
        return [_finding(ERROR, f"{where}: a file is not PEM ({exc})", _REMAKE)]
    findings: list[Finding] = []
    try:
        is_ca = ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    if not is_ca:
        findings.append(_finding(ERROR, f"{where}/ca.pem is not a CA certificate", _REMAKE))
    try:
        cert.verify_directly_issued_by(ca)
    except Exception as exc:  # InvalidSignature, ValueError (issuer name), TypeError (key type): all say "not ours"
        findings.append(_finding(ERROR, f"{where}/{CERT_FILE} is not signed by {where}/ca.pem "
                                        f"({type(exc).__name__}): the stages would refuse this node", _REMAKE))
    der, spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(der, spki) != cert.public_key().public_bytes(der, spki):
        findings.append(_finding(ERROR, f"{where}/{KEY_FILE} is not the key of {where}/{CERT_FILE}", _REMAKE))
    for name, c in (("ca.pem", ca), (CERT_FILE, cert)):
        start, end = c.not_valid_before_utc, c.not_valid_after_utc
        if now < start:
            findings.append(_finding(ERROR, f"{where}/{name} is not valid before {start:%Y-%m-%d %H:%M} UTC "
                                            "(is this node's clock right?)", "set the clock (sntp -sS time.apple.com)"))
        elif now > end:
            findings.append(_finding(ERROR, f"{where}/{name} expired on {end:%Y-%m-%d}", _REMAKE))
        elif end - now < dt.timedelta(days=EXPIRY_WARNING_DAYS):
            findings.append(_finding(WARNING, f"{where}/{name} expires on {end:%Y-%m-%d}", _REMAKE))
    try:
        usages = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        usages = {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}  # no EKU: any use
    if not {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH} <= usages:
        findings.append(_finding(ERROR, f"{where}/{CERT_FILE} must allow both server and client authentication "
                                        "(a node's stages serve and its gateway and coordinator call)", _REMAKE))
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        ips = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        dns = set(names.get_values_for_type(x509.DNSName))
    except x509.ExtensionNotFound:
        ips, dns = set(), set()
    wanted = host_ip or "127.0.0.1"
    if not _names(wanted, ips, dns):
        findings.append(_finding(ERROR, f"{where}/{CERT_FILE} does not name {wanted}, the address this node's stages "
                                        f"advertise (it names {', '.join(sorted(ips | dns)) or 'nothing'}): clients "
                                        "would refuse it", _REMAKE.replace("ADDRESS", wanted)))
    if key_mode is not None and key_mode & (stat.S_IRWXG | stat.S_IRWXO):
        findings.append(_finding(WARNING, f"{where}/{KEY_FILE} is readable by others (mode {key_mode:o})",
                                 f"chmod 600 {where}/{KEY_FILE}"))
    if not findings:
        subject = cert.subject.rfc4514_string()
        findings.append(_finding(OK, f"{where}: {subject}, signed by the mesh CA, names {wanted}, valid until "
                                     f"{cert.not_valid_after_utc:%Y-%m-%d}"))
    return findings


def _names(wanted: str, ips: set[str], dns: set[str]) -> bool:
    try:
        return str(ipaddress.ip_address(wanted)) in ips
    except ValueError:
        return wanted in dns


def check_tls_dir(path: str, *, host_ip: str | None, now: dt.datetime | None = None) -> list[Finding]:
    try:
        files = read_tls_dir(path)
    except ValueError as exc:
        return [_finding(ERROR, str(exc), _REMAKE)]
    try:
        key_mode = stat.S_IMODE(os.stat(os.path.join(files.directory, KEY_FILE)).st_mode)
    except OSError:
        key_mode = None
    return check_tls(files, host_ip=host_ip, key_mode=key_mode, now=now or dt.datetime.now(dt.UTC))
