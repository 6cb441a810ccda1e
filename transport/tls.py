"""A self-signed certificate for a server that was given none.

ECDSA P-256 with SAN `localhost` and `127.0.0.1`: Chromium refuses Ed25519 certificates (the
browser tests load pages over it). Made once and reused, so clients that pin it (by its SPKI
hash) keep working across restarts.
"""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import NameOID

DEFAULT_DIR = Path(__file__).resolve().parent.parent / ".certs"


def ensure_certificate(
    directory: Path = DEFAULT_DIR, deterministic: bool = False
) -> tuple[Path, Path]:
    """(cert.pem, key.pem) in `directory`, made now if either is missing.

    `deterministic`: Ed25519, whose signatures have a fixed size (ECDSA's DER signatures vary by a
    byte or two), so that handshakes in virtual-time simulations are the same on every run.
    Browsers refuse Ed25519; use it for simulations only."""
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    if cert_path.exists() and key_path.exists():
        return cert_path, key_path
    directory.mkdir(parents=True, exist_ok=True)
    key = (
        ed25519.Ed25519PrivateKey.generate()
        if deterministic
        else ec.generate_private_key(ec.SECP256R1())
    )
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .sign(key, None if deterministic else hashes.SHA256())
    )
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def spki_sha256(cert_path: Path) -> str:
    """The base64 SHA-256 of the certificate's public key, as Chromium's
    `--ignore-certificate-errors-spki-list` wants it."""
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    der = cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(der).digest()).decode()
