"""TLS on the HTTP API (``splitserve/tls.py``, ``docs/security.md``) with certificates this test
makes (``cryptography``): a router serving HTTPS in front of workers that serve HTTPS and require
a client certificate of our CA; the router trusts the workers' CA and presents its client
certificate. Also: a client without the certificate, a router that does not trust the CA or has
no client certificate, and bad files, each refused clearly."""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import subprocess
import sys

import pytest
import requests

from cluster import Cluster, RouterProcess
from conftest import REPO

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: E402


def _name(cn: str) -> "x509.Name":
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_certs(folder) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and localhost, a client certificate, and another
    CA's server certificate (untrusted): PEM files in ``folder``, by name."""
    now = datetime.datetime.now(datetime.timezone.utc)
    paths = {}

    def write(name: str, data: bytes) -> str:
        path = folder / name
        path.write_bytes(data)
        paths[name] = str(path)
        return str(path)

    def key_pem(key) -> bytes:
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    def issue(cn, key, issuer_name, issuer_key, *, ca=False, server=False):
        builder = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(issuer_name)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ca:
            builder = builder.add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False),
                                            critical=True)
            builder = builder.add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        else:
            builder = builder.add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
                                            critical=False)
            usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName(
                [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    for prefix in ("ca", "other-ca"):
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = issue(f"splitserve test {prefix}", ca_key, _name(f"splitserve test {prefix}"), ca_key, ca=True)
        write(f"{prefix}.pem", ca_cert.public_bytes(serialization.Encoding.PEM))
        for role, server in (("server", True), ("client", False)):
            key = ec.generate_private_key(ec.SECP256R1())
            cert = issue(f"{prefix} {role}", key, ca_cert.subject, ca_key, server=server)
            write(f"{prefix}-{role}.pem", cert.public_bytes(serialization.Encoding.PEM))
            write(f"{prefix}-{role}.key", key_pem(key))
    return paths


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def tls_cluster(certs):
    worker_tls = {"verify": certs["ca.pem"], "cert": (certs["ca-client.pem"], certs["ca-client.key"])}
    router_tls = {"verify": certs["ca.pem"]}
    serve = ["--ssl-certfile", certs["ca-server.pem"], "--ssl-keyfile", certs["ca-server.key"]]
    cluster = Cluster(prefill=1, decode=1, backend="tcp", worker_args=serve + ["--ssl-ca-certs", certs["ca.pem"]],
                      router_args=serve + ["--worker-ca-certs", certs["ca.pem"],
                                           "--worker-ssl-certfile", certs["ca-client.pem"],
                                           "--worker-ssl-keyfile", certs["ca-client.key"]],
                      worker_tls=worker_tls, router_tls=router_tls)
    with cluster:
        yield cluster


def test_https_end_to_end_with_client_certificates_to_the_workers(tls_cluster, certs):
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3}}
    r = requests.post(tls_cluster.url + "/generate", json=body, verify=certs["ca.pem"], timeout=60)
    assert tls_cluster.url.startswith("https://") and r.status_code == 200 and len(r.json()["output_ids"]) == 3
    assert "splitserve router ready: https://" in tls_cluster.router.output()
    with pytest.raises(requests.exceptions.SSLError):  # a client that does not trust our CA
        requests.get(tls_cluster.url + "/health", timeout=10)
    with pytest.raises(requests.exceptions.ConnectionError):  # plain HTTP on the TLS port
        requests.get(tls_cluster.url.replace("https://", "http://") + "/health", timeout=10).raise_for_status()
    for w in tls_cluster.workers:
        with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
            requests.get(w.url + "/health", verify=certs["ca.pem"], timeout=10)  # no client certificate
        other = (certs["other-ca-client.pem"], certs["other-ca-client.key"])
        with pytest.raises((requests.exceptions.SSLError, requests.exceptions.ConnectionError)):
            requests.get(w.url + "/health", verify=certs["ca.pem"], cert=other, timeout=10)  # another CA's
        assert requests.get(w.url + "/health", timeout=10, **tls_cluster.worker_tls).status_code == 200


@pytest.mark.parametrize("router_args, words", [
    ([], ("CERTIFICATE_VERIFY_FAILED",)),  # the workers' CA not trusted
    # trusted, but no client certificate: TLS 1.3 refuses after the handshake, so the router sees the
    # connection closed or reset, whichever the first read meets
    (["--worker-ca-certs", "ca.pem"], ("disconnected", "reset by peer")),
])
def test_a_router_the_workers_do_not_accept_sees_them_down_and_says_why(tls_cluster, certs, router_args, words):
    args = [certs.get(a, a) for a in router_args]
    router = RouterProcess([(p.url, p.bootstrap_port) for p in tls_cluster.prefill], [d.url for d in tls_cluster.decode],
                           *args, wait_healthy=False).start()
    try:
        health = requests.get(router.url + "/health", timeout=10)
        assert health.status_code == 503
        errors = [w["error"] for w in health.json()["prefill"] + health.json()["decode"]]
        assert errors and all(any(w.lower() in e.lower() for w in words) for e in errors), errors
    finally:
        router.stop()


BAD_TLS = [
    (["--ssl-certfile", "ca-server.pem"], "--ssl-certfile and --ssl-keyfile go together"),
    (["--ssl-ca-certs", "ca.pem"], "--ssl-ca-certs needs --ssl-certfile"),
    (["--ssl-certfile", "ca-server.pem", "--ssl-keyfile", "other-ca-server.key"], "not a certificate and its key"),
    (["--worker-ca-certs", "ca-server.key"], "--worker-ca-certs"),
]


@pytest.fixture(scope="module")
def bad_tls_routers(certs) -> list[tuple[int, str]]:
    """Each of ``BAD_TLS``'s routers run at once, side by side (each loads the router in a process
    of its own): its exit status and stderr."""
    procs = [subprocess.Popen([sys.executable, "-m", "splitserve.cli", "router", "--prefill", "http://127.0.0.1:9",
                               "--decode", "http://127.0.0.1:9", "--port", "0", *[certs.get(a, a) for a in args]],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
             for args, _ in BAD_TLS]
    try:
        seen = []
        for proc in procs:
            _, err = proc.communicate(timeout=240)  # a bound on a hang: four load at once
            seen.append((proc.returncode, err))
        return seen
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("case", range(len(BAD_TLS)), ids=[words for _, words in BAD_TLS])
def test_bad_tls_files_stop_the_router_at_once_with_exit_2(bad_tls_routers, case):
    returncode, stderr = bad_tls_routers[case]
    assert returncode == 2 and BAD_TLS[case][1] in stderr, stderr


def test_tls_contexts_refuse_what_they_cannot_use(certs):
    from splitserve.tls import client_context, server_context

    assert server_context(None, None, None) is None and client_context(None, None, None) is None
    ctx = server_context(certs["ca-server.pem"], certs["ca-server.key"], certs["ca.pem"])
    assert ctx.verify_mode is ssl.CERT_REQUIRED
    assert client_context(certs["ca.pem"], None, None).check_hostname
    with pytest.raises(ValueError, match="go together"):
        client_context(None, certs["ca-client.pem"], None)


def _handshake(ctx: ssl.SSLContext, certfile: str, keyfile: str) -> None:
    """A TLS handshake from ``ctx`` to a server on loopback presenting ``certfile``; raises if refused."""
    import socket
    import threading

    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(certfile, keyfile)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True):
                pass
        except (ssl.SSLError, OSError):
            pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        with socket.create_connection(listener.getsockname(), timeout=10) as raw:
            with ctx.wrap_socket(raw, server_hostname="127.0.0.1"):
                pass
    finally:
        listener.close()
        thread.join(10)


def test_worker_ca_certs_replace_the_system_cas(certs, monkeypatch):
    """The system's store (``SSL_CERT_FILE``, as OpenSSL reads it) trusts the other CA; with
    ``--worker-ca-certs`` naming our CA only, a worker certificate of the other CA is refused."""
    from splitserve.tls import client_context

    monkeypatch.setenv("SSL_CERT_FILE", certs["other-ca.pem"])
    other = (certs["other-ca-server.pem"], certs["other-ca-server.key"])
    _handshake(ssl.create_default_context(), *other)  # the simulated system store is in effect
    _handshake(client_context(None, certs["ca-client.pem"], certs["ca-client.key"]), *other)  # default: the system's
    with pytest.raises(ssl.SSLCertVerificationError, match="unable to get local issuer certificate"):
        _handshake(client_context(certs["ca.pem"], None, None), *other)
    _handshake(client_context(certs["ca.pem"], None, None), certs["ca-server.pem"], certs["ca-server.key"])
