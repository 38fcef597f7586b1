"""The server's private CA, host certificates and the TLS contexts of the control link (issue 31).

Who holds what:

- the server: the CA (``CertificateAuthority``, made at its first start in
  one directory, loaded from it after), and a certificate for its control
  listener (``server_certificate``) that names the addresses hosts dial;
- a host: its own key, which never leaves the machine (``host_key_and_csr``),
  and the client certificate the CA issued for its CSR (``sign_host``).

Both ends trust the CA alone, never the system's store, so a certificate
from any public CA is as foreign as one from another CapyCTL server. Keys
are ECDSA on P-256, which every OpenSSL that Python's ``ssl`` links
accepts for TLS 1.2 and 1.3. The extended key usages keep the roles apart:
OpenSSL refuses a host's certificate (clientAuth only) where a server's is
expected, and the reverse.

Private keys reach the disk only through ``write_private``: mode 0600 from
the moment the file exists, in a directory made 0700, renamed into place
so that a reader never sees half a key. Python's ``ssl`` loads a key only
from a file, so the contexts write theirs to a private temporary
directory for the time of the load.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import os
import ssl
import stat
import tempfile
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.hazmat.primitives.asymmetric.types import CertificatePublicKeyTypes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capyctl.domain.errors import InvalidConfig, InvalidRequest
from capyctl.domain.joining import check_host_name

CA_KEY = "ca-key.pem"
CA_CERT = "ca-cert.pem"
CA_DAYS = 3650  # ten years
SERVER_DAYS = 365
_SKEW = datetime.timedelta(minutes=5)  # certificates start a little in the past: clocks disagree


def write_private(path: Path, data: bytes) -> None:
    """``data`` written to ``path`` for its owner's eyes only (0600), atomically; a missing parent is made 0700."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


class CertificateAuthority:
    """The server's CA: its key signs the control certificate and each host's certificate."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, certificate: x509.Certificate) -> None:
        self._key = key
        self.certificate = certificate
        self.cert_pem = certificate.public_bytes(serialization.Encoding.PEM)

    @classmethod
    def load_or_create(cls, directory: Path, name: str = "capyctl") -> CertificateAuthority:
        """The CA kept in ``directory``, made there first when there is none (the key 0600, the directory 0700).

        A directory holding a certificate without its key, a key others may
        read, or a key that is not the certificate's is refused rather than
        replaced: every host that joined trusts the CA that is there.
        """
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
        key_path, cert_path = directory / CA_KEY, directory / CA_CERT
        if not key_path.exists():
            if cert_path.exists():
                raise InvalidConfig(
                    f"{cert_path} is there but the CA's key {key_path} is missing; restore the key, "
                    "or move the directory away to make a new CA (every host must then join again)"
                )
            write_private(key_path, _pem_key(ec.generate_private_key(ec.SECP256R1())))
        mode = stat.S_IMODE(key_path.stat().st_mode)
        if mode & 0o077:
            raise InvalidConfig(
                f"the CA's key {key_path} may be read by others (mode {mode:04o}); "
                f"make it private with: chmod 600 {key_path}"
            )
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise InvalidConfig(f"{key_path} is not an EC key of a CapyCTL CA")
        if not cert_path.exists():  # a first start, or one cut off between the two writes
            write_private(cert_path, _self_signed(key, name).public_bytes(serialization.Encoding.PEM))
        certificate = x509.load_pem_x509_certificate(cert_path.read_bytes())
        if _public(certificate.public_key()) != _public(key.public_key()):
            raise InvalidConfig(f"{cert_path} is not the certificate of the key {key_path}")
        return cls(key, certificate)

    def server_certificate(self, names: list[str], days: int = SERVER_DAYS) -> tuple[bytes, bytes]:
        """A certificate and fresh key (PEM) for the control listener, valid for each DNS name or IP of ``names``."""
        if not names:
            raise InvalidConfig("the control listener's certificate needs at least one name or address")
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = []
        for entry in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(entry)))
            except ValueError:
                alt.append(x509.DNSName(entry))
        cert = self._issue(key.public_key(), names[0], alt, [ExtendedKeyUsageOID.SERVER_AUTH], days)
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def sign_host(self, csr_pem: bytes, name: str, days: int = 365) -> bytes:
        """The certificate (PEM) for host ``name``'s CSR (client of the control link, server of its ingress);
        InvalidRequest when the CSR is not ``name``'s.

        Only the CSR's key and common name are taken; whatever else it asks
        for is ignored, and the certificate says what the CA decides.
        """
        check_host_name(name)
        try:
            csr = x509.load_pem_x509_csr(csr_pem)
        except ValueError as exc:
            raise InvalidRequest("the join request's CSR is not a PEM certificate request", param="csr") from exc
        if not csr.is_signature_valid:
            raise InvalidRequest("the join request's CSR is not signed by its own key", param="csr")
        names = [attr.value for attr in csr.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
        if names != [name]:
            raise InvalidRequest(
                f"the join request's CSR names {names or 'no host'}, not host {name!r}; "
                "the host must make its CSR for its own name",
                param="csr",
            )
        public = csr.public_key()
        if not _acceptable(public):
            raise InvalidRequest(
                "the CSR's key is of a kind or size the control link does not accept "
                "(take EC P-256/P-384, Ed25519 or RSA of 2048 bits or more)",
                param="csr",
            )
        if days < 1:
            raise InvalidRequest(f"a host certificate lasts at least 1 day; got {days}", param="days")
        # client (the control link) and server (the host's ingress, which the server reaches by the host's name)
        cert = self._issue(
            public, name, [x509.DNSName(name)], [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH], days
        )
        return cert.public_bytes(serialization.Encoding.PEM)

    def _issue(
        self,
        public: CertificatePublicKeyTypes,
        common_name: str,
        alt: list[x509.GeneralName],
        usage: list[x509.ObjectIdentifier],
        days: int,
    ) -> x509.Certificate:
        ca_key_id = self.certificate.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        return (
            _builder(subject, self.certificate.subject, public, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_usage(signing=True), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_key_id), critical=False)
            .sign(self._key, hashes.SHA256())
        )


def host_key_and_csr(name: str) -> tuple[bytes, bytes]:
    """A fresh key and a CSR for host ``name`` (both PEM): the host's side of joining."""
    check_host_name(name)
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _pem_key(key), csr.public_bytes(serialization.Encoding.PEM)


def caller_certificate(name: str, days: int = SERVER_DAYS) -> tuple[bytes, bytes]:
    """A self-signed client certificate and its fresh key (PEM) for the server's calls to hosts' ingresses.

    Not signed by the CA, on purpose: every host's certificate is, so an
    ingress that trusted the CA for its callers would let any host in. An
    ingress trusts this one certificate alone (it is handed over the
    control link), so OpenSSL itself fails the handshake of any other
    client. ``name`` is one no host may take (``check_host_name``).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    cert = (
        _builder(subject, subject, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_usage(signing=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)


def fingerprint(cert: bytes) -> str:
    """The SHA-256 of a certificate (PEM or DER) in lower-case hex: how the server tells a host's certificates apart."""
    return _load(cert).fingerprint(hashes.SHA256()).hex()


def host_name_of(cert: bytes) -> str:
    """The common name of a certificate (PEM or DER): for a peer the handshake verified, the host that connected."""
    names = [attr.value for attr in _load(cert).subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    if len(names) != 1 or not isinstance(names[0], str):
        raise InvalidRequest("the peer's certificate does not name exactly one host")
    return names[0]


def server_ssl_context(cert_pem: bytes, key_pem: bytes, ca_pem: bytes, require_client: bool) -> ssl.SSLContext:
    """The control listener's TLS: its certificate, and clients' certificates checked against ``ca_pem`` only.

    With ``require_client`` a client without a certificate fails the
    handshake; without it such a client is let through (it may only join),
    while one that shows a certificate must still show one the CA signed.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(context, ca_pem)
    context.verify_mode = ssl.CERT_REQUIRED if require_client else ssl.CERT_OPTIONAL
    _load_chain(context, cert_pem, key_pem)
    return context


def client_ssl_context(
    ca_pem: bytes,
    cert_pem: bytes | None = None,
    key_pem: bytes | None = None,
    server_name: str | None = None,
    names_checked: bool = False,
) -> ssl.SSLContext:
    """A dialling side's TLS: the server must show a certificate of ``ca_pem``; ours is shown when given.

    With ``server_name`` (or ``names_checked``, for a context that dials
    several servers) the server's certificate must also name the
    ``server_hostname`` given when wrapping (OpenSSL refuses to check a name
    it was not given, so forgetting it fails, never passes).
    """
    if (cert_pem is None) != (key_pem is None):
        raise InvalidConfig("a client certificate needs its key, and a key its certificate")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # verifies the peer; no store loaded yet
    _harden(context, ca_pem)
    context.check_hostname = server_name is not None or names_checked
    context.verify_mode = ssl.CERT_REQUIRED
    if cert_pem is not None and key_pem is not None:
        _load_chain(context, cert_pem, key_pem)
    return context


def _harden(context: ssl.SSLContext, ca_pem: bytes) -> None:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.verify_flags |= ssl.VERIFY_X509_STRICT
    context.load_verify_locations(cadata=ca_pem.decode())  # the pinned CA, and nothing else


def _load_chain(context: ssl.SSLContext, cert_pem: bytes, key_pem: bytes) -> None:
    with tempfile.TemporaryDirectory(prefix="capyctl-tls-") as scratch:  # made 0700
        cert, key = Path(scratch) / "cert.pem", Path(scratch) / "key.pem"
        write_private(cert, cert_pem)
        write_private(key, key_pem)
        context.load_cert_chain(cert, key)


def _builder(
    subject: x509.Name, issuer: x509.Name, public: CertificatePublicKeyTypes, days: int
) -> x509.CertificateBuilder:
    """A certificate's common part: who, by whom, its key, a random serial, valid from a little in the past."""
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _SKEW)
        .not_valid_after(now + datetime.timedelta(days=days))
    )


def _self_signed(key: ec.EllipticCurvePrivateKey, name: str) -> x509.Certificate:
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} CA")])
    key_id = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    return (
        _builder(subject, subject, key.public_key(), CA_DAYS)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_usage(signing=False), critical=True)
        .add_extension(key_id, critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(key_id), critical=False)
        .sign(key, hashes.SHA256())
    )


def _usage(*, signing: bool) -> x509.KeyUsage:
    """A leaf signs handshakes (digital signature); the CA signs certificates and revocation lists only."""
    return x509.KeyUsage(
        digital_signature=signing,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=not signing,
        crl_sign=not signing,
        encipher_only=False,
        decipher_only=False,
    )


def _acceptable(public: object) -> bool:
    if isinstance(public, ec.EllipticCurvePublicKey):
        return isinstance(public.curve, ec.SECP256R1 | ec.SECP384R1)
    if isinstance(public, rsa.RSAPublicKey):
        return public.key_size >= 2048
    return isinstance(public, ed25519.Ed25519PublicKey)


def _load(cert: bytes) -> x509.Certificate:
    try:
        if cert.lstrip().startswith(b"-----BEGIN"):
            return x509.load_pem_x509_certificate(cert)
        return x509.load_der_x509_certificate(cert)
    except ValueError as exc:
        raise InvalidRequest("not an X.509 certificate (PEM or DER)") from exc


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _public(key: CertificatePublicKeyTypes) -> bytes:
    return key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
