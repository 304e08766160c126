"""A private certificate authority and a server certificate it signs, for a stack served over https on
this machine (tests, a trial of the exposed set-up). Production uses the certificate and key you provide
(docker/.env: TLS_CERT_FILE, TLS_KEY_FILE) and gives clients the CA that signed it (docs/security.md).

    tls = make_certificates(home / "tls", hosts=["127.0.0.1", "localhost"])
    tls.cert, tls.key   # for the servers (start-prefect-server.sh / start-mlflow.sh: TLS_CERT_FILE, TLS_KEY_FILE)
    tls.ca              # for every client (PREFECT_API_SSL_CERT_FILE, MLFLOW_TRACKING_SERVER_CERT_PATH)
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gptcore.files import atomic_write_bytes


@dataclass(frozen=True)
class Certificates:
    ca: Path    # the CA's certificate: what clients trust
    cert: Path  # the server's certificate (signed by the CA)
    key: Path   # the server's private key (mode 0600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_certificates(directory: Path, hosts: list[str], days: int = 30) -> Certificates:
    """A new CA and a certificate for `hosts` (IP addresses or DNS names) under `directory`; files that
    exist are reused, so a restarted stack keeps the certificate its clients already trust."""
    directory = Path(directory)
    out = Certificates(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem")
    if all(p.is_file() for p in (out.ca, out.cert, out.key)):
        return out
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    now = dt.datetime.now(dt.UTC)
    not_before, not_after = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("gpt2-pipeline test CA")
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name)
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(not_before).not_valid_after(not_after)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    key = ec.generate_private_key(ec.SECP256R1())
    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    cert = (x509.CertificateBuilder().subject_name(_name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(not_before).not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))

    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    atomic_write_bytes(out.key, [key_pem])  # the directory is 0700: no one else reads it meanwhile
    os.chmod(out.key, 0o600)
    atomic_write_bytes(out.cert, [_pem(cert)])
    atomic_write_bytes(out.ca, [_pem(ca)])  # last: its presence means the set is complete
    return out
