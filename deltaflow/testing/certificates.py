"""A certificate authority for tests and local trials of TLS: a CA, and node or client
certificates it signs, written as PEM files (needs the ``cryptography`` package, a dev
dependency).

Usage::

    ca = CertificateAuthority(directory)
    node = ca.issue("node-1", hosts=["127.0.0.1", "localhost"], peer=True)  # .cert, .key
    client = ca.issue("client")
    # deltaflow serve --tls-cert node.cert --tls-key node.key --tls-ca ca.cert ...
    # deltaflow.connect(..., tls=deltaflow.ClientTls(ca=ca.cert, cert=client.cert, key=client.key))
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["CertificateAuthority", "Issued"]


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its key, as PEM files."""

    cert: str
    key: str


class CertificateAuthority:
    """A self-signed CA in ``directory`` (``<name>.cert``, ``<name>.key``), valid for a day."""

    def __init__(self, directory: Path, name: str = "deltaflow-test-ca") -> None:
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = self._builder(self._name, self._key.public_key()).add_extension(
            x509.BasicConstraints(ca=True, path_length=None), critical=True
        )
        self._cert = builder.sign(self._key, _sha256())
        self.cert = self._write(name, self._cert, self._key).cert

    def issue(self, name: str, hosts: Sequence[str] = (), *, peer: bool = False) -> Issued:
        """A certificate for ``name`` signed by this CA, naming ``hosts`` (IP addresses or DNS
        names) as its subject alternative names: a node's certificate must name the host
        clients and peers reach it at. ``peer``: it also names the peer role
        (:data:`deltaflow.security.PEER_ROLE_URI`), which nodes and operators need under
        mutual TLS without a peer token; a client's certificate lacks it."""
        from cryptography import x509
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = self._builder(subject, key.public_key()).add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        if peer:
            from ..security import PEER_ROLE_URI

            names.append(x509.UniformResourceIdentifier(PEER_ROLE_URI))
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        return self._write(name, builder.sign(self._key, _sha256()), key)

    def _builder(self, subject: Any, public_key: Any) -> Any:
        from cryptography import x509

        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self._name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    def _write(self, name: str, cert: Any, key: Any) -> Issued:
        from cryptography.hazmat.primitives import serialization

        cert_path = self.directory / f"{name}.cert"
        key_path = self.directory / f"{name}.key"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        key_path.chmod(0o600)
        return Issued(str(cert_path), str(key_path))


def _sha256() -> Any:
    from cryptography.hazmat.primitives import hashes

    return hashes.SHA256()
