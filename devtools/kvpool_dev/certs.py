"""Certificates and kubeconfigs for a loopback control plane.

One self-signed CA signs the API server's serving certificate and one client certificate per
component; the API server trusts that CA for client auth, so identity comes from the
certificate subject (CN = user, O = groups) exactly as in a kubeadm cluster. EC P-256 keys keep
generation instant.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = dt.timedelta(days=365)

API_SERVER_DNS = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


@dataclass(frozen=True)
class ClientIdentity:
    """A component's user name and groups, written into its client certificate."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = ClientIdentity("admin", "kubernetes-admin", ("system:masters",))
CONTROLLER_MANAGER = ClientIdentity("controller-manager", "system:kube-controller-manager")
SCHEDULER = ClientIdentity("scheduler", "system:kube-scheduler")
# kwok plays the kubelet of every fake node; it needs cluster-wide node and pod status writes.
KWOK = ClientIdentity("kwok", "kwok-controller", ("system:masters",))
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, KWOK)


@dataclass(frozen=True)
class PkiPaths:
    """Files under ``<cluster dir>/pki``."""

    dir: Path

    @property
    def ca_cert(self) -> Path:
        return self.dir / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.dir / "ca.key"

    @property
    def apiserver_cert(self) -> Path:
        return self.dir / "apiserver.crt"

    @property
    def apiserver_key(self) -> Path:
        return self.dir / "apiserver.key"

    @property
    def sa_key(self) -> Path:
        return self.dir / "sa.key"

    @property
    def sa_pub(self) -> Path:
        return self.dir / "sa.pub"

    def client_cert(self, who: ClientIdentity) -> Path:
        return self.dir / f"{who.file_stem}.crt"

    def client_key(self, who: ClientIdentity) -> Path:
        return self.dir / f"{who.file_stem}.key"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str, orgs: tuple[str, ...] = ()) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in orgs]
    attrs.append(x509.NameAttribute(NameOID.COMMON_NAME, cn))
    return x509.Name(attrs)


def _builder(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALIDITY)
    )


def _issue(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    subject: x509.Name,
    usage: x509.ObjectIdentifier,
    sans: list[x509.GeneralName] | None = None,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    builder = (
        _builder(subject, ca_cert.subject, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=True,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def service_account_identity(namespace: str, name: str) -> ClientIdentity:
    """The user name and groups the API server gives a service account's tokens."""
    return ClientIdentity(
        f"sa-{namespace}-{name}",
        f"system:serviceaccount:{namespace}:{name}",
        ("system:serviceaccounts", f"system:serviceaccounts:{namespace}"),
    )


def issue_client_cert(pki: PkiPaths, who: ClientIdentity, directory: Path) -> tuple[Path, Path]:
    """A client certificate from the cluster CA for ``who``: RBAC then sees that identity
    (tests use it to act as a service account without bearer-token handling)."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
    key, cert = _issue(
        ca_key, ca_cert, _name(who.user, who.groups), ExtendedKeyUsageOID.CLIENT_AUTH
    )
    cert_path, key_path = directory / f"{who.file_stem}.crt", directory / f"{who.file_stem}.key"
    _write_cert(cert, cert_path)
    _write_key(key, key_path)
    return cert_path, key_path


def generate_pki(pki: PkiPaths, service_ip: str) -> None:
    """Write the CA, the API server cert, the service-account key pair and client certs."""
    pki.dir.mkdir(parents=True, exist_ok=True)
    ca_key = _key()
    ca_name = _name("kvpool-dev-cluster-ca")
    ca_cert = (
        _builder(ca_name, ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
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
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(ca_key, pki.ca_key)
    _write_cert(ca_cert, pki.ca_cert)

    sans: list[x509.GeneralName] = [x509.DNSName(d) for d in API_SERVER_DNS]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", service_ip)]
    key, cert = _issue(
        ca_key, ca_cert, _name("kube-apiserver"), ExtendedKeyUsageOID.SERVER_AUTH, sans
    )
    _write_key(key, pki.apiserver_key)
    _write_cert(cert, pki.apiserver_cert)

    sa_key = _key()
    _write_key(sa_key, pki.sa_key)
    pki.sa_pub.write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )

    for who in CLIENTS:
        key, cert = _issue(
            ca_key, ca_cert, _name(who.user, who.groups), ExtendedKeyUsageOID.CLIENT_AUTH
        )
        _write_key(key, pki.client_key(who))
        _write_cert(cert, pki.client_cert(who))


def write_kubeconfig(
    path: Path, server: str, pki: PkiPaths, who: ClientIdentity, cluster_name: str
) -> None:
    """A kubeconfig with absolute file references, usable by kubectl, helm and Python."""
    user = who.file_stem
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster_name,
                "cluster": {"server": server, "certificate-authority": str(pki.ca_cert)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {
                    "client-certificate": str(pki.client_cert(who)),
                    "client-key": str(pki.client_key(who)),
                },
            }
        ],
        "contexts": [{"name": cluster_name, "context": {"cluster": cluster_name, "user": user}}],
        "current-context": cluster_name,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
