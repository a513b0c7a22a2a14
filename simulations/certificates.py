"""TLS files for a deployment: a private certificate authority and a server certificate.

The SuperLink serves its APIs over TLS with a certificate signed by this CA; SuperNodes and
the `flwr` CLI trust the CA (`--root-certificates`, config.toml `root-certificates`). All the
cryptography is the `cryptography` package's (ECDSA P-256, SHA-256); this module only chooses
names, lifetimes and file layout.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the PEM files: the CA certificate, the server's certificate and its key."""

    ca_certificate: Path
    server_certificate: Path
    server_key: Path


def certificate_authority(
    name: str = "fedfields deployment CA", days: int = 30
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A new self-signed CA: its private key and certificate (may sign, may not be a leaf)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, certificate


def server_certificate(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_certificate: x509.Certificate,
    hosts: tuple[str, ...] = LOOPBACK_HOSTS,
    days: int = 30,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A server key and certificate signed by the CA, valid for `hosts` (IPs or DNS names)."""
    if not hosts:
        raise ValueError("server_certificate needs at least one host name or IP address")
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.now(UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=5))
        .not_valid_after(now + timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, certificate


def write_tls_files(directory: Path, hosts: tuple[str, ...] = LOOPBACK_HOSTS) -> TlsFiles:
    """Make a CA and a server certificate for `hosts`, write them as PEM into `directory`.

    The private keys are written readable by their owner only; the CA's key is not kept at
    all (nothing else is ever signed with it).
    """
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_certificate = certificate_authority()
    key, certificate = server_certificate(ca_key, ca_certificate, hosts)
    files = TlsFiles(
        ca_certificate=directory / "ca.crt",
        server_certificate=directory / "server.pem",
        server_key=directory / "server.key",
    )
    files.ca_certificate.write_bytes(ca_certificate.public_bytes(serialization.Encoding.PEM))
    files.server_certificate.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    descriptor = os.open(files.server_key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "wb") as file:
        file.write(key_pem)
    return files
