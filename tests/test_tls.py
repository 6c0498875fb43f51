"""TLS (issue #36, defect 2): ``fl-server serve --tls-cert/--tls-key`` serves HTTPS with a certificate made
here (a private CA and a server certificate for 127.0.0.1, ``cryptography``); a device that pins that CA
(``EdgeClient(..., ca_file=...)``) joins and downloads, one that does not is refused by certificate
verification, and plain HTTP to the TLS port gets nowhere."""
from __future__ import annotations

import datetime
import ipaddress
import re
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from coordinator_proc import REPO, Coordinator, start, start_copy
from edge_sdk import EdgeClient, EdgeClientError
from fl_server.signing import ManifestSigner
from reliability_log import record

pytestmark = pytest.mark.timeout(600)


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def make_ca_and_cert(out: Path, host: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """(server certificate, its key, the CA certificate) as PEM files in ``out``: a self-signed CA valid for a
    day and a server certificate it signed for ``host`` (an IP address SAN)."""
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fl-edge test CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
          .sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
            .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(host))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    out.mkdir(parents=True, exist_ok=True)
    paths = out / "cert.pem", out / "key.pem", out / "ca.pem"
    paths[0].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_key(key, paths[1])
    paths[2].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    return paths


@pytest.fixture(scope="module")
def tls_server(trained_store: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    files = make_ca_and_cert(tmp_path_factory.mktemp("tls"))
    coord = start_copy(trained_store, tmp_path_factory.mktemp("tls-store") / "store", tls=files)
    yield coord, files[2]
    coord.stop()


def test_a_device_that_pins_the_ca_joins_and_downloads_over_tls(tls_server: tuple[Coordinator, Path],
                                                               tmp_path: Path) -> None:
    coord, ca = tls_server
    assert coord.url.startswith("https://")
    key = ManifestSigner.from_pem(coord.store / "signing_key.pem").public_hex
    with EdgeClient(coord.url, cache_dir=tmp_path, ca_file=ca, public_key=key) as c:
        assert c.health()["status"] == "ok"
        info = c.join("TENT")
        assert c.download(info.manifest, method="TENT").method == "TENT"
    record("transport", "device with the pinned CA against an HTTPS coordinator", "joined and downloaded")


def test_without_the_pinned_ca_the_certificate_is_refused(tls_server: tuple[Coordinator, Path],
                                                          tmp_path: Path) -> None:
    coord, _ = tls_server
    with EdgeClient(coord.url, cache_dir=tmp_path / "a", retries=0) as c:  # default CAs: not this private CA
        with pytest.raises(EdgeClientError, match=r"unreachable \(ConnectError: .*CERTIFICATE_VERIFY_FAILED"):
            c.health()
    other = make_ca_and_cert(tmp_path / "other")[2]  # a CA, but not the one that signed the server's certificate
    with EdgeClient(coord.url, cache_dir=tmp_path / "b", retries=0, ca_file=other) as c:
        with pytest.raises(EdgeClientError, match="CERTIFICATE_VERIFY_FAILED"):
            c.join()
    with EdgeClient(coord.url.replace("https://", "http://"), cache_dir=tmp_path / "c", retries=0) as c:
        with pytest.raises(EdgeClientError):  # plain HTTP to the TLS port: no answer a device could use
            c.health()
    with pytest.raises(EdgeClientError, match=r"ca_file '.*nothing\.pem': not a readable PEM CA certificate"):
        EdgeClient(coord.url, cache_dir=tmp_path / "d", ca_file=tmp_path / "nothing.pem")
    record("transport", "device without the coordinator's CA (default CAs, another CA, plain HTTP)",
           "refused: certificate verification failed")


def test_tls_flags_go_together(tmp_path: Path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    missing = str(tmp_path / "no.pem")
    for args, message in ((["--tls-cert", str(cert)], "--tls-cert and --tls-key go together"),
                          (["--tls-cert", str(cert), "--tls-key", missing], "--tls-key .*no such file")):
        out = subprocess.run([sys.executable, "-m", "fl_server.cli", "serve", "--store", str(tmp_path / "s"), *args],
                             cwd=REPO, capture_output=True, text=True, timeout=120)
        assert out.returncode == 2
        assert re.search(f"^error: {message}", out.stderr, re.M), out.stderr


def test_a_connection_that_sends_no_client_hello_counts_and_is_closed(tmp_path: Path) -> None:
    """Issue 50, D3/N5: a TLS connection that never sent a ClientHello was held 60 s (asyncio's handshake
    timeout), outside the connection cap. Now it counts toward FL_SERVE_MAX_CONNECTIONS while open and is closed
    within the head deadline."""
    files = make_ca_and_cert(tmp_path / "tls")
    coord = start(tmp_path / "store", methods="", tls=files,
                  env={"FL_SERVE_MAX_CONNECTIONS": "4", "FL_SERVE_HEAD_TIMEOUT_S": "1"})
    verify = ssl.create_default_context(cafile=str(files[2]))
    try:
        port = int(coord.url.rsplit(":", 1)[1])
        held = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        time.sleep(0.3)
        assert httpx.get(f"{coord.url}/v1/signing-key", verify=verify, timeout=10).status_code == 503
        start_t = time.monotonic()
        for s in held:  # closed by the server (EOF or reset), not after 60 s
            try:
                assert s.recv(1) == b""
            except ConnectionResetError:
                pass
        assert time.monotonic() - start_t < 4
        assert httpx.get(f"{coord.url}/v1/signing-key", verify=verify, timeout=10).status_code == 200
        for s in held:
            s.close()
    finally:
        coord.stop()
