"""The deployment's TLS files: a server certificate for 127.0.0.1 that verifies against the CA."""

import ipaddress
import stat
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key

from simulations.certificates import write_tls_files


def test_server_certificate_verifies_against_ca_for_loopback(tmp_path: Path) -> None:
    files = write_tls_files(tmp_path / "tls")
    ca = x509.load_pem_x509_certificate(files.ca_certificate.read_bytes())
    server = x509.load_pem_x509_certificate(files.server_certificate.read_bytes())
    server.verify_directly_issued_by(ca)  # raises if the signature or issuer is wrong
    names = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert ipaddress.ip_address("127.0.0.1") in names.get_values_for_type(x509.IPAddress)
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    key = load_pem_private_key(files.server_key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key().public_numbers() == server.public_key().public_numbers()
    assert stat.S_IMODE(files.server_key.stat().st_mode) == 0o600


def test_each_call_makes_a_new_authority(tmp_path: Path) -> None:
    first = write_tls_files(tmp_path / "a").ca_certificate.read_bytes()
    assert first != write_tls_files(tmp_path / "b").ca_certificate.read_bytes()
