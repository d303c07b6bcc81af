"""Certificates and keys for the local cluster, generated fresh for every cluster.

One CA signs the apiserver's serving certificate (SANs: localhost, 127.0.0.1 and the
``kubernetes`` Service address pods dial) and one client certificate per identity: the
admin (in ``system:masters``), the apiserver's own client for kubelets, and each real
node's kubelet (``system:node:<name>`` in ``system:nodes``, what the Node authorizer and
NodeRestriction recognise; :func:`issue_client_cert`). A separate RSA key pair signs
service-account tokens. Nothing here leaves the cluster's directory.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALIDITY = dt.timedelta(days=30)


@dataclass(frozen=True)
class Pki:
    """Paths of every file the control plane needs."""

    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    kubelet_client_cert: Path
    kubelet_client_key: Path
    sa_public: Path
    sa_private: Path


SERVICE_ADDRESS = "10.0.0.1"
"""The ``kubernetes`` Service's address in the cluster's service range (10.0.0.0/24)."""

def _write_key(path: Path, key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organisation: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organisation:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation))
    return x509.Name(attrs)


def _builder(subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
             ) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
    )


def _client_cert(ca_key: ec.EllipticCurvePrivateKey, ca_name: x509.Name, common_name: str,
                 organisation: str | None) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _builder(_name(common_name, organisation), ca_name, key.public_key())
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key


def issue_client_cert(pki: Pki, directory: Path, name: str, *, common_name: str,
                      organisation: str | None = None) -> tuple[Path, Path]:
    """A client certificate signed by the cluster CA, written as ``<name>.crt/.key``."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the cluster CA key is not an EC key")
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    cert, key = _client_cert(ca_key, ca_cert.subject, common_name, organisation)
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    _write_key(key_path, key)
    _write_cert(cert_path, cert)
    return cert_path, key_path


def generate(directory: Path) -> Pki:
    """Write a CA, a serving certificate, an admin client certificate and SA keys."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("rota-local-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )

    serving_key = ec.generate_private_key(ec.SECP256R1())
    serving_cert = (
        _builder(_name("kube-apiserver"), ca_name, serving_key.public_key())
        .add_extension(
            x509.SubjectAlternativeName([
                x509.DNSName("localhost"),
                x509.DNSName("kubernetes"),
                x509.DNSName("kubernetes.default.svc"),
                x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                x509.IPAddress(ipaddress.ip_address(SERVICE_ADDRESS)),
            ]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    admin_cert, admin_key = _client_cert(ca_key, ca_name, "rota-admin", "system:masters")
    kubelet_client_cert, kubelet_client_key = _client_cert(
        ca_key, ca_name, "kube-apiserver-kubelet-client", "system:masters")

    sa_key = rsa.generate_private_key(public_exponent=65537, key_size=2048)

    pki = Pki(
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        admin_cert=directory / "admin.crt",
        admin_key=directory / "admin.key",
        kubelet_client_cert=directory / "apiserver-kubelet-client.crt",
        kubelet_client_key=directory / "apiserver-kubelet-client.key",
        sa_public=directory / "sa.pub",
        sa_private=directory / "sa.key",
    )
    _write_key(pki.ca_key, ca_key)
    _write_cert(pki.ca_cert, ca_cert)
    _write_key(pki.serving_key, serving_key)
    _write_cert(pki.serving_cert, serving_cert)
    _write_key(pki.admin_key, admin_key)
    _write_cert(pki.admin_cert, admin_cert)
    _write_key(pki.kubelet_client_key, kubelet_client_key)
    _write_cert(pki.kubelet_client_cert, kubelet_client_cert)
    _write_key(pki.sa_private, sa_key)
    pki.sa_public.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def write_kubeconfig(path: Path, *, server: str, pki: Pki, user: str = "rota-admin",
                     client_cert: Path | None = None, client_key: Path | None = None) -> None:
    """Write a kubeconfig that reaches ``server`` as a client certificate (the admin's
    unless another is given)."""
    text = f"""apiVersion: v1
kind: Config
clusters:
- name: rota-local
  cluster:
    server: {server}
    certificate-authority: {pki.ca_cert}
users:
- name: {user}
  user:
    client-certificate: {client_cert or pki.admin_cert}
    client-key: {client_key or pki.admin_key}
contexts:
- name: rota-local
  context:
    cluster: rota-local
    user: {user}
current-context: rota-local
"""
    path.write_text(text)
    path.chmod(0o600)
