"""A server safe to expose: loopback unless a token is given, TLS with a real (self-signed) certificate, tokens
from the environment and from files, per-token rate and session limits (429 + Retry-After) and clients that back
off."""

from __future__ import annotations

import datetime
import http.client
import ipaddress
import json
import os
import ssl
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from conftest import tiny_classifier
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from incrinf.cli import build_parser, main
from incrinf.cli import serve as serve_cli
from incrinf.models import sample_image
from incrinf.normalization import Normalization
from incrinf.offload.client import OffloadClient, RateLimited, RemoteError, ServerUnavailable, SessionLost
from incrinf.offload.config import ServerConfig
from incrinf.offload.credentials import ENV_TOKEN, InsecureTokenFile, client_token, is_loopback, read_token_file
from incrinf.offload.limits import RateLimiter
from incrinf.offload.server import ModelService, OffloadServer
from incrinf.offload.session import OffloadingSession
from incrinf.testing.synthetic import synthetic_camera

TOKEN, OTHER = "robot-1 secret", "robot-2-secret"
SIZE = 64
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def service() -> ModelService:
    return ModelService(tiny_classifier(), (3, SIZE, SIZE), name="tiny", mean=MEAN, std=STD, timing_repeats=1,
                        session_ttl=30.0)


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    return [f for f, _ in synthetic_camera(sample_image(), 12, size=(SIZE, SIZE), motion="pan")]


def reference(frame: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return tiny_classifier()(Normalization(MEAN, STD).tensor(frame)).numpy()


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and localhost, made now: (cert.pem, key.pem)."""
    folder = tmp_path_factory.mktemp("tls")
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / "cert.pem", folder / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    key_file.chmod(0o600)
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def tls_server(service, certificate):
    cert, key = certificate
    server = OffloadServer(service, tokens=(TOKEN, OTHER), tls_cert=cert, tls_key=key).start()
    yield server
    server.stop()


def raw(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
        context: ssl.SSLContext | None = None) -> tuple[int, dict, dict]:
    """One request on a fresh connection: (status, headers, JSON body or {})."""
    if context is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        try:
            js = json.loads(data)
        except ValueError:
            js = {}
        return resp.status, dict(resp.getheaders()), js
    finally:
        conn.close()


# --- binding ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.3.2.1", True), ("::1", True), ("localhost", True), ("LOCALHOST.", True),
    ("0.0.0.0", False), ("::", False), ("", False), ("192.168.1.20", False), ("robot-server.local", False),
])
def test_loopback_addresses(host, loopback):
    assert is_loopback(host) is loopback


def test_public_interface_needs_a_token_or_insecure(service):
    for host in ("0.0.0.0", "::", "10.0.0.7"):
        with pytest.raises(ValueError, match="without a token"):
            OffloadServer(service, host=host)
        assert OffloadServer(service, host=host, token=TOKEN).config.public
        assert OffloadServer(service, host=host, insecure=True).config.public
    assert not OffloadServer(service, host="127.0.0.1").config.public


def test_serve_refuses_public_interface_without_token(capsys, monkeypatch):
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    # Refused before the model is even loaded: exit status 2 and a message saying what to do.
    assert main(["serve", "--model", "resnet18", "--host", "0.0.0.0", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "refusing to serve on '0.0.0.0' without a token" in err and "--insecure" in err


# --- tokens ------------------------------------------------------------------------------------------------


def test_token_file_and_environment(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(ENV_TOKEN, raising=False)
    path = tmp_path / "tokens"
    path.write_text(f"# one token per robot\n{TOKEN}\n\n  {OTHER}  \n")
    path.chmod(0o600)
    assert read_token_file(path) == [TOKEN, OTHER]
    path.chmod(0o644)
    with pytest.warns(InsecureTokenFile, match="readable by other users"):
        read_token_file(path)
    (tmp_path / "empty").write_text("# nothing\n")
    (tmp_path / "empty").chmod(0o600)
    with pytest.raises(ValueError, match="holds no token"):
        read_token_file(tmp_path / "empty")
    (tmp_path / "bad").write_text("ok-token\nbad\x07token\n")
    (tmp_path / "bad").chmod(0o600)
    with pytest.raises(ValueError, match="line 2") as info:
        read_token_file(tmp_path / "bad")
    assert "bad\x07token" not in str(info.value)  # a message never repeats a secret
    parser = build_parser()

    def tokens_of(*argv: str) -> tuple[str, ...]:
        return serve_cli.server_config(parser.parse_args(["serve", "--model", "resnet18", *argv])).tokens

    assert tokens_of("--token-file", str(path)) == (TOKEN, OTHER)
    assert "readable by other users" in capsys.readouterr().err
    assert tokens_of() == ()
    assert "warning" not in capsys.readouterr().err
    monkeypatch.setenv(ENV_TOKEN, "from-the-environment")
    assert tokens_of() == ("from-the-environment",)
    assert tokens_of("--token", "typed") == ("typed",)
    assert "visible to every user of this machine in the process list" in capsys.readouterr().err
    # clients: the environment unless a token is given; "" means none
    assert client_token(None) == "from-the-environment"
    assert client_token("given") == "given"
    assert client_token("") is None
    assert repr(ServerConfig(tokens=(TOKEN,))).count(TOKEN) == 0


def test_clients_read_the_token_from_the_environment(service, frames, monkeypatch):
    with OffloadServer(service, token=TOKEN) as server:
        monkeypatch.delenv(ENV_TOKEN, raising=False)
        with pytest.raises(RemoteError) as info:
            OffloadClient(server.url).infer_full(frames[0])
        assert info.value.status == 401
        monkeypatch.setenv(ENV_TOKEN, TOKEN)
        client = OffloadClient(server.url)
        np.testing.assert_allclose(client.infer_full(frames[0]).output, reference(frames[0]), rtol=1e-5, atol=1e-6)
        assert TOKEN not in repr(client)
        session = OffloadingSession(tiny_classifier(), offload=server.url, policy="offload_full", mean=MEAN, std=STD,
                                    timing_repeats=1)
        with session:
            outputs = [session(f) for f in frames[:3]]
        assert [s.mode.policy for s in session.stats] == ["offload_full"] * 3
        for out, frame in zip(outputs, frames):
            np.testing.assert_allclose(out.numpy(), reference(frame), rtol=1e-5, atol=1e-6)


def test_each_token_is_its_own_credential(service, frames):
    with OffloadServer(service, tokens=(TOKEN, OTHER)) as server:
        alice, bob = OffloadClient(server.url, TOKEN), OffloadClient(server.url, OTHER)
        session = alice.open_session()
        alice.infer_full(frames[0], session, 0)
        with pytest.raises(SessionLost):  # the same id under another credential is unknown
            bob.infer_full(frames[1], session, 1)
        with pytest.raises(SessionLost):
            bob.close_session(session)
        alice.close_session(session)


def test_serve_subprocess_with_token_file(tmp_path):
    """The real command: tokens from a file, nothing secret on the command line or in /health."""
    path = tmp_path / "tokens"
    path.write_text(f"{TOKEN}\n{OTHER}\n")
    path.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k != ENV_TOKEN}
    code = "import sys; from incrinf.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", "--model", "squeezenet1_1", "--input", "3x64x64",
                             "--port", "0", "--token-file", str(path), "--profile-repeats", "1", "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = None
        for line in proc.stdout:
            if " on http" in line:
                url = line.split(" on ", 1)[1].split()[0]
                break
        assert url is not None, "the server did not start"
        assert "2 accepted" in line
        health = OffloadClient(url, token="").health()
        assert health["auth"] == "token" and health["tls"] is False
        assert health["limits"]["sessions_per_token"] == 32
        assert TOKEN not in json.dumps(health) and OTHER not in json.dumps(health)
        with pytest.raises(RemoteError) as info:
            OffloadClient(url, token="wrong").profile()
        assert info.value.status == 401
        assert OffloadClient(url, token=OTHER).profile()["model"] == "squeezenet1_1"
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM is a clean shutdown


# --- TLS -------------------------------------------------------------------------------------------------------


def test_tls_round_trip_verifies_the_certificate(tls_server, certificate, frames):
    cert, _ = certificate
    assert tls_server.url.startswith("https://")
    for host in ("127.0.0.1", "localhost"):  # both names are in the certificate
        client = OffloadClient(f"https://{host}:{tls_server.port}", TOKEN, ca_file=cert)
        reply = client.infer_full(frames[0])
        np.testing.assert_allclose(reply.output, reference(frames[0]), rtol=1e-5, atol=1e-6)
        client.close()
    # verified by default: a self-signed certificate that the client was not told to trust is refused
    with pytest.raises(ServerUnavailable, match="certificate"):
        OffloadClient(tls_server.url, TOKEN).health()
    assert OffloadClient(tls_server.url, TOKEN, verify=False).health()["tls"] is True
    # plain HTTP to the TLS port gets no answer; the server goes on serving
    with pytest.raises(ServerUnavailable):
        OffloadClient(f"http://127.0.0.1:{tls_server.port}", TOKEN).health(timeout=2)
    assert OffloadClient(tls_server.url, TOKEN, ca_file=cert).health()["status"] == "ok"


def test_tls_401_without_or_with_a_wrong_token(tls_server, certificate, frames):
    context = ssl.create_default_context(cafile=certificate[0])
    from incrinf.offload import wire

    body = wire.encode({"frame": frames[0]})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {TOKEN}x"},
                    {"Authorization": f"Basic {TOKEN}"}):
        status, response_headers, js = raw(tls_server.port, "POST", "/infer/full", body, headers, context)
        assert status == 401 and "token" in js["error"]
        assert response_headers["WWW-Authenticate"].startswith("Bearer")
    assert raw(tls_server.port, "GET", "/health", context=context)[0] == 200
    for token in (TOKEN, OTHER):
        assert raw(tls_server.port, "POST", "/infer/full", body, {"Authorization": f"Bearer {token}"},
                   context)[0] == 200
    with pytest.raises(RemoteError) as info:
        OffloadClient(tls_server.url, token="", ca_file=certificate[0]).infer_full(frames[0])
    assert info.value.status == 401


def test_offloading_session_over_tls(tls_server, certificate, frames):
    session = OffloadingSession(tiny_classifier(), offload=tls_server.url, policy="offload_changed_pixels", token=OTHER,
                                ca_file=certificate[0], mean=MEAN, std=STD, timing_repeats=1, pixel_threshold=0.0,
                                max_ratio=1.0)
    with session:
        outputs = [session(f) for f in frames[:6]]
    assert [s.mode.policy for s in session.stats] == ["offload_changed_pixels"] * 6
    assert sum(not s.full_upload for s in session.stats) >= 4  # deltas over TLS
    for out, frame in zip(outputs, frames):
        np.testing.assert_allclose(out.numpy(), reference(frame), rtol=1e-4, atol=1e-5)


def test_bad_tls_settings_fail_clearly(service, certificate, tmp_path):
    cert, key = certificate
    with pytest.raises(ValueError, match="both a certificate and its key"):
        OffloadServer(service, tls_cert=cert)
    with pytest.raises(FileNotFoundError, match="TLS key file not found"):
        OffloadServer(service, tls_cert=cert, tls_key=str(tmp_path / "missing.pem"))
    (tmp_path / "junk.pem").write_text("not a key")
    with pytest.raises(ValueError, match="cannot load TLS certificate"):
        OffloadServer(service, tls_cert=cert, tls_key=str(tmp_path / "junk.pem"))
    with pytest.raises(FileNotFoundError, match="CA file not found"):
        OffloadClient("https://127.0.0.1:1", ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="http://host:port or https://host:port"):
        OffloadClient("ftp://127.0.0.1:1")


# --- limits ------------------------------------------------------------------------------------------------------


def test_rate_limiter_token_bucket():
    limiter = RateLimiter(rate=10.0, burst=3)
    assert [limiter.acquire("a", now=0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert limiter.acquire("a", now=0.0) == pytest.approx(0.1)
    assert limiter.acquire("b", now=0.0) == 0.0  # per key
    assert limiter.acquire("a", now=0.1) == 0.0  # refilled one
    assert RateLimiter(rate=0.0, burst=1).acquire("a") == 0.0  # 0 = no limit
    many = RateLimiter(rate=1.0, burst=1, max_keys=100)
    for i in range(1000):
        many.acquire(f"peer:{i}", now=0.0)
    assert len(many) <= 100  # a flood of addresses cannot grow memory


def test_rate_limit_429_with_retry_after_and_client_waits(service, frames):
    with OffloadServer(service, tokens=(TOKEN, OTHER), requests_per_second=4.0, burst=2) as server:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert raw(server.port, "GET", "/profile", headers=auth)[0] == 200
        assert raw(server.port, "GET", "/profile", headers=auth)[0] == 200
        status, headers, js = raw(server.port, "GET", "/profile", headers=auth)
        assert status == 429 and headers["Retry-After"] == "1" and 0 < js["retry_after"] <= 0.25
        # per credential: the other token is not slowed down; /health is never limited
        assert raw(server.port, "GET", "/profile", headers={"Authorization": f"Bearer {OTHER}"})[0] == 200
        assert raw(server.port, "GET", "/health")[0] == 200
        # wrong tokens are limited per address, so guessing is no faster than the rate
        statuses = [raw(server.port, "GET", "/profile", headers={"Authorization": "Bearer guess"})[0]
                    for _ in range(4)]
        assert statuses[:2] == [401, 401] and 429 in statuses[2:]
        # a client that may wait sleeps for Retry-After once and gets through
        waiting = OffloadClient(server.url, TOKEN, wait_rate_limited=True)
        t0 = time.perf_counter()
        waiting.infer_full(frames[0], timeout=2.0)
        assert time.perf_counter() - t0 >= 0.1
        # one that may not (or whose timeout is shorter than the wait) raises RateLimited at once
        eager = OffloadClient(server.url, TOKEN, wait_rate_limited=False)
        with pytest.raises(RateLimited) as info:
            for _ in range(3):
                eager.infer_full(frames[0])
        assert info.value.status == 429 and 0 < info.value.retry_after <= 0.25


def test_offloading_session_backs_off_under_rate_limit_and_loses_no_frame(service, frames):
    rate, burst = 5.0, 2
    with OffloadServer(service, token=TOKEN, requests_per_second=rate, burst=burst) as server:
        session = OffloadingSession(tiny_classifier(), offload=server.url, policy="offload_full", token=TOKEN,
                                    mean=MEAN, std=STD, timing_repeats=1, backoff_initial=0.01, backoff_cap=0.05,
                                    keep_stats=None)
        outputs = []
        t0 = time.monotonic()
        with session:  # a camera faster than the rate, for 2 s at least (however loaded the machine)
            while (time.monotonic() - t0 < 2.0 or len(outputs) < 20) and len(outputs) < 5000:
                outputs.append(session(frames[len(outputs) % len(frames)]))
        elapsed = time.monotonic() - t0
    references = [reference(f) for f in frames]
    for i, out in enumerate(outputs):  # every frame has its output, offloaded or computed locally
        np.testing.assert_allclose(out.numpy(), references[i % len(frames)], rtol=1e-5, atol=1e-6)
    stats = session.stats
    assert [s.index for s in stats] == list(range(len(outputs)))

    def refused(s) -> bool:
        return s.fallback and "RateLimited" in s.error

    attempts = [s for s in stats if s.mode.policy == "offload_full" or s.fallback]  # the frames that sent a request
    assert any(map(refused, attempts)) and any(s.mode.policy == "offload_full" for s in attempts[1:])
    # Retry-After honoured: after a refusal the next request waits until the bucket has a token again, so it is
    # admitted; and nothing goes out while waiting (those frames run locally, "server down")
    assert not any(refused(a) and refused(b) for a, b in zip(attempts, attempts[1:]))
    assert sum(s.mode.policy == "offload_full" for s in stats) <= burst + rate * elapsed + 1
    assert all("unavailable" in s.reason for s in stats if s.mode.policy == "local_full" and not s.fallback)


def test_sessions_per_token_429_and_health_reports_limits(service):
    with OffloadServer(service, tokens=(TOKEN, OTHER), sessions_per_token=2, requests_per_second=0) as server:
        alice, bob = OffloadClient(server.url, TOKEN), OffloadClient(server.url, OTHER)
        first, _ = alice.open_session(), alice.open_session()
        with pytest.raises(RateLimited) as info:
            alice.open_session(timeout=0.5)  # Retry-After (~ the 30 s TTL) does not fit: raised at once
        assert 25 <= info.value.retry_after <= 30
        bob.open_session()  # the cap is per credential
        alice.close_session(first)
        alice.open_session()
        health = OffloadClient(server.url, token="").health()
        assert health["limits"] == {"requests_per_second": 0.0, "burst": 400, "sessions_per_token": 2,
                                    "max_request_bytes": 16 << 20, "max_sessions": 256, "session_ttl": 30.0}
        assert health["auth"] == "token" and health["open_sessions"] >= 3
        assert TOKEN not in json.dumps(health)


def test_timeouts_do_not_leak_server_sessions_into_the_cap(frames):
    """A frame whose offload times out keeps its server cache: reopening one per timeout would fill the
    credential's session cap and lock the camera out for a TTL (seen in the soak benchmark)."""
    from incrinf.testing.shaping import ShapingProxy

    service = ModelService(tiny_classifier(), (3, SIZE, SIZE), name="tiny", mean=MEAN, std=STD, timing_repeats=1)
    with OffloadServer(service, token=TOKEN, sessions_per_token=2) as server, ShapingProxy(server.port) as proxy:
        session = OffloadingSession(tiny_classifier(), offload=f"http://127.0.0.1:{proxy.port}",
                                    policy="offload_changed_pixels", token=TOKEN, mean=MEAN, std=STD, timing_repeats=1,
                                    max_timeout=0.3, backoff_initial=0.01, backoff_cap=0.02, pixel_threshold=0.0,
                                    max_ratio=1.0)
        for i in range(4):
            session(frames[i])
        for _ in range(3):  # three timeouts, each followed by a recovery
            proxy.set_link(1000.0, 1000.0)  # latency, not bandwidth: nothing queues on the emulated link
            session(frames[4])
            proxy.set_link(1000.0, 0.0)
            for k in range(200):  # until it offloads again (back-off, then a health check)
                time.sleep(0.01)
                session(frames[5 + k % 6])
                if session.stats[-1].mode.policy == "offload_changed_pixels":
                    break
        stats = session.stats
        assert sum(s.fallback and "ServerUnavailable" in s.error for s in stats) == 3
        assert not any("RateLimited" in (s.error or "") for s in stats)
        assert stats[-1].mode.policy == "offload_changed_pixels"
        assert service.sessions.count() == 1
        session.close()
        assert service.sessions.count() == 0  # closed on the server too
