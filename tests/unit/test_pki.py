"""The private CA, host certificates and the control link's TLS, checked with real keys and real handshakes.

Handshakes run over TCP on 127.0.0.1 (a port the kernel picks), the server
side in a thread; every socket has a timeout, so a test that goes wrong
fails within seconds instead of hanging.
"""

from __future__ import annotations

import base64
import socket
import ssl
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from capyctl.adapters.pki import (
    CA_CERT,
    CA_KEY,
    CertificateAuthority,
    client_ssl_context,
    fingerprint,
    host_key_and_csr,
    host_name_of,
    server_ssl_context,
    write_private,
)
from capyctl.domain.errors import InvalidConfig, InvalidRequest

SERVER = "capyctl-server"
TIMEOUT = 5.0


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    return CertificateAuthority.load_or_create(tmp_path_factory.mktemp("ca") / "ca")


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> CertificateAuthority:
    """Another server's CA, with the very same subject name as ``ca``: only its key tells them apart."""
    return CertificateAuthority.load_or_create(tmp_path_factory.mktemp("other") / "ca")


def host_cert(authority: CertificateAuthority, name: str) -> tuple[bytes, bytes]:
    key_pem, csr_pem = host_key_and_csr(name)
    return authority.sign_host(csr_pem, name), key_pem


# --- the CA on disk ----------------------------------------------------------------------------------------


def test_the_ca_is_made_once_with_a_private_key_and_loaded_identical_after(tmp_path: Path) -> None:
    directory = tmp_path / "state" / "identity" / "ca"
    first = CertificateAuthority.load_or_create(directory)
    assert mode(directory) == 0o700
    assert mode(directory / CA_KEY) == 0o600
    assert sorted(p.name for p in directory.iterdir()) == [CA_CERT, CA_KEY]  # no temporary file left behind
    again = CertificateAuthority.load_or_create(directory)
    assert again.cert_pem == first.cert_pem
    assert fingerprint(again.cert_pem) == fingerprint(first.cert_pem)
    # and the reloaded key is the one that signs: a certificate it issues verifies against the first's cert
    cert_pem, _ = host_cert(again, "gpu-a")
    x509.load_pem_x509_certificate(cert_pem).verify_directly_issued_by(first.certificate)


def test_the_ca_certificate_is_a_ten_year_ca_that_signs_certificates_only(ca: CertificateAuthority) -> None:
    cert = ca.certificate
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca is True
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
    assert usage.critical and usage.value.key_cert_sign and not usage.value.digital_signature
    years = (cert.not_valid_after_utc - cert.not_valid_before_utc).days / 365
    assert 9.9 < years < 10.1
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    cert.verify_directly_issued_by(cert)  # self-signed


def test_two_cas_never_share_a_key(ca: CertificateAuthority, other_ca: CertificateAuthority) -> None:
    assert ca.certificate.subject == other_ca.certificate.subject
    assert fingerprint(ca.cert_pem) != fingerprint(other_ca.cert_pem)
    with pytest.raises(InvalidSignature):
        ca.certificate.verify_directly_issued_by(other_ca.certificate)


def test_a_ca_directory_with_its_key_gone_or_readable_by_others_is_refused_not_replaced(tmp_path: Path) -> None:
    directory = tmp_path / "ca"
    made = CertificateAuthority.load_or_create(directory)
    (directory / CA_KEY).chmod(0o644)
    with pytest.raises(InvalidConfig, match="chmod 600"):
        CertificateAuthority.load_or_create(directory)
    (directory / CA_KEY).unlink()
    with pytest.raises(InvalidConfig, match="missing"):
        CertificateAuthority.load_or_create(directory)
    assert (directory / CA_CERT).read_bytes() == made.cert_pem  # the certificate hosts trust is still there


def test_write_private_is_0600_atomic_and_makes_a_missing_parent_0700(tmp_path: Path) -> None:
    path = tmp_path / "identity" / "host-key.pem"
    write_private(path, b"first")
    write_private(path, b"second")
    assert path.read_bytes() == b"second"
    assert mode(path) == 0o600 and mode(path.parent) == 0o700
    assert [p.name for p in path.parent.iterdir()] == ["host-key.pem"]


# --- host certificates -------------------------------------------------------------------------------------


def test_a_host_csr_is_signed_into_a_certificate_for_that_host(ca: CertificateAuthority) -> None:
    key_pem, csr_pem = host_key_and_csr("gpu-a")
    cert_pem = ca.sign_host(csr_pem, "gpu-a")
    cert = x509.load_pem_x509_certificate(cert_pem)
    cert.verify_directly_issued_by(ca.certificate)
    assert host_name_of(cert_pem) == "gpu-a"
    assert host_name_of(cert.public_bytes(serialization.Encoding.DER)) == "gpu-a"
    # a client of the control link, and the server of the host's ingress (reached by the host's name)
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.CLIENT_AUTH, ExtendedKeyUsageOID.SERVER_AUTH]
    )
    assert cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(
        x509.DNSName
    ) == ["gpu-a"]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    # the certificate carries the host's own key, which never went to the CA
    key = serialization.load_pem_private_key(key_pem, password=None)
    assert cert.public_key() == key.public_key()
    # each certificate has its own random serial, and the fingerprint is of its bytes
    again = x509.load_pem_x509_certificate(ca.sign_host(csr_pem, "gpu-a"))
    assert again.serial_number != cert.serial_number
    assert fingerprint(cert_pem) == cert.fingerprint(hashes.SHA256()).hex()
    assert len(fingerprint(cert_pem)) == 64


def test_a_csr_for_another_name_is_refused(ca: CertificateAuthority) -> None:
    _, csr_pem = host_key_and_csr("gpu-b")
    with pytest.raises(InvalidRequest, match="not host 'gpu-a'"):
        ca.sign_host(csr_pem, "gpu-a")


def test_a_csr_whose_signature_does_not_verify_is_refused(ca: CertificateAuthority) -> None:
    _, csr_pem = host_key_and_csr("gpu-a")
    der = bytearray(x509.load_pem_x509_csr(csr_pem).public_bytes(serialization.Encoding.DER))
    der[-3] ^= 0x01  # inside the signature
    forged = (
        b"-----BEGIN CERTIFICATE REQUEST-----\n"
        + base64.encodebytes(bytes(der))
        + b"-----END CERTIFICATE REQUEST-----\n"
    )
    with pytest.raises(InvalidRequest, match="not signed"):
        ca.sign_host(forged, "gpu-a")


def test_a_csr_that_is_not_one_or_names_no_host_is_refused(ca: CertificateAuthority) -> None:
    with pytest.raises(InvalidRequest, match="not a PEM"):
        ca.sign_host(b"hello", "gpu-a")
    key = ec.generate_private_key(ec.SECP256R1())
    nameless = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "x")]))
        .sign(key, hashes.SHA256())
    )
    with pytest.raises(InvalidRequest, match="names no host"):
        ca.sign_host(nameless.public_bytes(serialization.Encoding.PEM), "gpu-a")
    with pytest.raises(InvalidRequest, match="host name"):
        host_key_and_csr("GPU_A")


def test_the_server_certificate_names_dns_names_and_ip_addresses(ca: CertificateAuthority) -> None:
    cert_pem, key_pem = ca.server_certificate([SERVER, "10.0.0.1", "::1"])
    cert = x509.load_pem_x509_certificate(cert_pem)
    cert.verify_directly_issued_by(ca.certificate)
    alt = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert alt.get_values_for_type(x509.DNSName) == [SERVER]
    assert [str(ip) for ip in alt.get_values_for_type(x509.IPAddress)] == ["10.0.0.1", "::1"]
    assert cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value == x509.ExtendedKeyUsage(
        [ExtendedKeyUsageOID.SERVER_AUTH]
    )
    assert b"PRIVATE KEY" in key_pem
    with pytest.raises(InvalidConfig):
        ca.server_certificate([])


# --- handshakes --------------------------------------------------------------------------------------------


@dataclass
class Handshake:
    client_error: BaseException | None = None
    server_error: BaseException | None = None
    received: bytes | None = None  # what the server read after its handshake
    answer: bytes | None = None  # what the client read back
    peer: bytes | None = None  # the client's certificate as the server saw it (DER)
    version: str | None = None


def handshake(server: ssl.SSLContext, client: ssl.SSLContext, server_hostname: str | None = SERVER) -> Handshake:
    """One connection over 127.0.0.1: the client sends b"ping" once its handshake is done, the server
    answers b"pong" once its own is done and it read the ping."""
    seen = Handshake()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(TIMEOUT)
    port = listener.getsockname()[1]

    def serve() -> None:
        try:
            conn, _ = listener.accept()
            conn.settimeout(TIMEOUT)
            with server.wrap_socket(conn, server_side=True) as tls:
                seen.peer = tls.getpeercert(binary_form=True)
                seen.received = tls.recv(16)
                tls.sendall(b"pong")
        except (ssl.SSLError, OSError) as exc:
            seen.server_error = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT) as raw,
            client.wrap_socket(raw, server_hostname=server_hostname) as tls,
        ):
            seen.version = tls.version()
            tls.sendall(b"ping")
            seen.answer = tls.recv(16)
    except (ssl.SSLError, OSError) as exc:
        seen.client_error = exc
    finally:
        thread.join(2 * TIMEOUT)
        listener.close()
    assert not thread.is_alive(), "the server side did not finish"
    return seen


@pytest.fixture(scope="module")
def listener_tls(ca: CertificateAuthority) -> ssl.SSLContext:
    cert_pem, key_pem = ca.server_certificate([SERVER, "127.0.0.1"])
    return server_ssl_context(cert_pem, key_pem, ca.cert_pem, require_client=True)


def test_mutual_tls_with_a_host_certificate_succeeds_and_names_the_host(
    ca: CertificateAuthority, listener_tls: ssl.SSLContext
) -> None:
    cert_pem, key_pem = host_cert(ca, "gpu-a")
    seen = handshake(listener_tls, client_ssl_context(ca.cert_pem, cert_pem, key_pem, server_name=SERVER))
    assert seen.client_error is None and seen.server_error is None
    assert seen.received == b"ping" and seen.answer == b"pong"
    assert seen.version == "TLSv1.3"
    assert seen.peer is not None and host_name_of(seen.peer) == "gpu-a"
    assert fingerprint(seen.peer) == fingerprint(cert_pem)


def test_a_host_certificate_from_another_ca_is_refused_by_the_server(
    ca: CertificateAuthority, other_ca: CertificateAuthority, listener_tls: ssl.SSLContext
) -> None:
    cert_pem, key_pem = host_cert(other_ca, "gpu-a")
    seen = handshake(listener_tls, client_ssl_context(ca.cert_pem, cert_pem, key_pem, server_name=SERVER))
    assert isinstance(seen.server_error, ssl.SSLCertVerificationError)
    assert seen.received is None and seen.answer != b"pong"


def test_a_client_without_a_certificate_is_refused_where_one_is_required(
    ca: CertificateAuthority, listener_tls: ssl.SSLContext
) -> None:
    seen = handshake(listener_tls, client_ssl_context(ca.cert_pem, server_name=SERVER))
    assert isinstance(seen.server_error, ssl.SSLError)
    assert seen.received is None and seen.answer != b"pong"


def test_without_require_client_a_bare_client_may_talk_but_a_foreign_certificate_may_not(
    ca: CertificateAuthority, other_ca: CertificateAuthority
) -> None:
    cert_pem, key_pem = ca.server_certificate([SERVER])
    joining = server_ssl_context(cert_pem, key_pem, ca.cert_pem, require_client=False)
    bare = handshake(joining, client_ssl_context(ca.cert_pem, server_name=SERVER))
    assert bare.answer == b"pong" and bare.peer is None
    foreign_cert, foreign_key = host_cert(other_ca, "gpu-a")
    foreign = handshake(joining, client_ssl_context(ca.cert_pem, foreign_cert, foreign_key, server_name=SERVER))
    assert isinstance(foreign.server_error, ssl.SSLCertVerificationError) and foreign.received is None


def test_the_client_refuses_a_server_of_another_ca_before_sending_a_byte(
    ca: CertificateAuthority, other_ca: CertificateAuthority
) -> None:
    cert_pem, key_pem = other_ca.server_certificate([SERVER])
    impostor = server_ssl_context(cert_pem, key_pem, other_ca.cert_pem, require_client=False)
    seen = handshake(impostor, client_ssl_context(ca.cert_pem, server_name=SERVER))
    assert isinstance(seen.client_error, ssl.SSLCertVerificationError)
    assert "Hostname mismatch" not in seen.client_error.verify_message  # refused for its issuer, not its name
    assert seen.received is None and seen.version is None  # the ping was never sent


def test_the_client_checks_the_server_name_it_was_given(ca: CertificateAuthority, listener_tls: ssl.SSLContext) -> None:
    cert_pem, key_pem = host_cert(ca, "gpu-a")
    wrong = handshake(
        listener_tls,
        client_ssl_context(ca.cert_pem, cert_pem, key_pem, server_name="elsewhere"),
        server_hostname="elsewhere",
    )
    assert isinstance(wrong.client_error, ssl.SSLCertVerificationError) and wrong.received is None
    assert "Hostname mismatch" in wrong.client_error.verify_message
    by_ip = handshake(
        listener_tls,
        client_ssl_context(ca.cert_pem, cert_pem, key_pem, server_name="127.0.0.1"),
        server_hostname="127.0.0.1",
    )
    assert by_ip.answer == b"pong"


def test_a_host_certificate_cannot_pose_as_the_server(ca: CertificateAuthority) -> None:
    """A joined host holds a certificate of the same CA, which may serve (its ingress) but only under its own
    name: the server's name is refused to hosts, and a host's certificate fails the check of that name."""
    with pytest.raises(InvalidRequest, match="server's own certificate"):
        host_key_and_csr(SERVER)
    cert_pem, key_pem = host_cert(ca, "gpu-a")
    posing = server_ssl_context(cert_pem, key_pem, ca.cert_pem, require_client=False)
    seen = handshake(posing, client_ssl_context(ca.cert_pem, server_name=SERVER))
    assert isinstance(seen.client_error, ssl.SSLCertVerificationError) and seen.received is None
    assert "hostname mismatch" in seen.client_error.verify_message.lower()


def test_the_server_certificate_cannot_pose_as_a_host(ca: CertificateAuthority, listener_tls: ssl.SSLContext) -> None:
    cert_pem, key_pem = ca.server_certificate([SERVER])
    seen = handshake(listener_tls, client_ssl_context(ca.cert_pem, cert_pem, key_pem, server_name=SERVER))
    assert isinstance(seen.server_error, ssl.SSLCertVerificationError) and seen.received is None
    assert "purpose" in seen.server_error.verify_message


def test_the_contexts_trust_the_pinned_ca_only_and_speak_tls_12_or_later(ca: CertificateAuthority) -> None:
    client = client_ssl_context(ca.cert_pem, server_name=SERVER)
    assert [c["subject"] for c in client.get_ca_certs()] == [((("commonName", "capyctl CA"),),)]
    assert client.minimum_version == ssl.TLSVersion.TLSv1_2
    assert client.check_hostname and client.verify_mode == ssl.CERT_REQUIRED
    assert not client_ssl_context(ca.cert_pem).check_hostname
    cert_pem, key_pem = ca.server_certificate([SERVER])
    server = server_ssl_context(cert_pem, key_pem, ca.cert_pem, require_client=True)
    assert len(server.get_ca_certs()) == 1 and server.minimum_version == ssl.TLSVersion.TLSv1_2
    with pytest.raises(InvalidConfig):
        client_ssl_context(ca.cert_pem, cert_pem=cert_pem)
