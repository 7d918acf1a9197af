"""Fuzzing the live offload server with raw HTTP: any method, path, headers, lengths and body get a 2xx-4xx answer
(or, for a request too malformed to answer, a closed connection), never a 5xx or a hang, and the server serves a
good request right after."""

from __future__ import annotations

import http.client
import logging
import socket
import urllib.parse

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from incrinf.models import sample_image
from incrinf.normalization import Normalization
from incrinf.offload import wire
from incrinf.offload.server import ModelService, OffloadServer
from incrinf.testing.synthetic import synthetic_camera

TOKEN = "fuzz-token"
SIZE = 32
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                         HealthCheck.too_slow])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                         nn.Flatten(), nn.Linear(8, 5)).eval()


FRAME = synthetic_camera(sample_image(), 1, size=(SIZE, SIZE))[0][0]
GOOD_BODY = wire.encode({"frame": FRAME})
with torch.no_grad():
    GOOD_OUTPUT = _model()(Normalization(MEAN, STD).tensor(FRAME)).numpy()


@pytest.fixture(scope="module")
def server():
    service = ModelService(_model(), (3, SIZE, SIZE), mean=MEAN, std=STD, timing_repeats=1)
    srv = OffloadServer(service, token=TOKEN, max_request_bytes=64_000, requests_per_second=0).start()
    yield srv
    srv.stop()


ROUTES = ["/", "/health", "/profile", "/session", "/infer/full", "/infer/cached", "/infer/suffix", "/probe",
          "/infer", "/infer/full/", "/../../etc/passwd", "/%00", "/health?x=%ff", "//infer//full", "/" + "a" * 3000]
TCHAR = "!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"  # RFC 9110 token
HEADER_NAME = st.one_of(st.text(st.sampled_from(TCHAR), min_size=1, max_size=20),  # mostly valid names
                        st.text(st.characters(min_codepoint=33, max_codepoint=126, exclude_characters=":"),
                                min_size=1, max_size=20).filter(lambda _: True))
HEADER_VALUE = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)


@st.composite
def requests(draw) -> tuple[bytes, bool]:
    """``(request bytes, whether it is complete)``: an incomplete one (a body shorter than its length, chunks
    without their end) is answered only when the client closes its side."""
    method = draw(st.sampled_from(["GET", "POST", "POST", "POST", "DELETE", "PUT", "PATCH", "HEAD", "OPTIONS",
                                   "BREW", "G\x7fT", "POST /x"]))
    path = draw(st.one_of(st.sampled_from(ROUTES), st.just("/infer/suffix?k=") .map(
        lambda p: p + urllib.parse.quote(draw(st.text(max_size=12)))), st.text(min_size=1, max_size=30).map(
        lambda p: "/" + urllib.parse.quote(p, safe="/?=&"))))
    body = draw(st.one_of(st.just(b""), st.just(GOOD_BODY), st.binary(max_size=300),
                          st.just(GOOD_BODY).map(lambda b: b[:draw(st.integers(0, len(b)))]),
                          st.just(wire.encode({"frame": np.zeros((SIZE, SIZE + 1, 3), np.uint8)}))))
    headers: list[tuple[str, str]] = [("Host", "127.0.0.1")]
    # about half of the requests well-formed and authorised, so that many reach the handlers
    auth = draw(st.sampled_from(["right"] * 6 + ["none", "wrong", "lower", "basic", "empty", "long"]))
    headers += {"right": [("Authorization", f"Bearer {TOKEN}")], "none": [],
                "wrong": [("Authorization", "Bearer nope")], "lower": [("authorization", f"bearer {TOKEN}")],
                "basic": [("Authorization", f"Basic {TOKEN}")], "empty": [("Authorization", "")],
                "long": [("Authorization", "Bearer " + "x" * 9000)]}[auth]
    length = draw(st.sampled_from(["exact"] * 9 + ["none", "short", "long", "negative", "junk", "huge", "twice",
                                                   "chunked", "chunked+length"]))
    headers += {"exact": [("Content-Length", str(len(body)))], "none": [],
                "short": [("Content-Length", str(max(len(body) - 5, 0)))],
                "long": [("Content-Length", str(len(body) + 100))], "negative": [("Content-Length", "-1")],
                "junk": [("Content-Length", "12abc")], "huge": [("Content-Length", str(10**20))],
                "twice": [("Content-Length", str(len(body))), ("Content-Length", str(len(body) + 1))],
                "chunked": [("Transfer-Encoding", "chunked")],
                "chunked+length": [("Transfer-Encoding", "chunked"), ("Content-Length", str(len(body)))]}[length]
    complete = length not in ("long", "huge", "chunked", "chunked+length")
    if length.startswith("chunked") and draw(st.booleans()):
        body = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
        complete = True
    if draw(st.booleans()):
        headers.append(("X-Incrinf-Session", draw(st.sampled_from(["", "0", "x" * 300, "\u00e9t\u00e9"]))))
    if draw(st.booleans()):
        headers.append(("Content-Type", draw(st.sampled_from([wire.CONTENT_TYPE, "application/json", "text/plain",
                                                              "multipart/form-data; boundary=x"]))))
    if draw(st.integers(0, 3)) == 0:
        headers += draw(st.lists(st.tuples(HEADER_NAME, HEADER_VALUE), min_size=1, max_size=2))
    headers.append(("Connection", "close"))  # the server closes after its answer: read to the end
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers) + "\r\n"
    return head.encode("latin-1", "replace") + body, complete


def _send_raw(port: int, request: bytes, complete: bool) -> bytes:
    """Send the bytes (closing our side after an incomplete request), read until the server closes; a server that
    does neither within 10 s hangs, and fails the test with a timeout."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        try:
            sock.sendall(request)
            if not complete:
                sock.shutdown(socket.SHUT_WR)
        except OSError:  # the server may close early, e.g. on an oversized header
            pass
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    return b"".join(chunks)


def _good_request(port: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", "/infer/full", GOOD_BODY, {"Authorization": f"Bearer {TOKEN}",
                                                         "Content-Type": wire.CONTENT_TYPE})
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    assert response.status == 200, data[:200]
    np.testing.assert_allclose(wire.decode(data).tensor("output"), GOOD_OUTPUT, rtol=1e-5, atol=1e-6)


def _cut(path: str) -> tuple[bytes, bool]:
    """A request whose client hangs up in the middle of the body (was logged as a server failure, a 500)."""
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 104\r\n"
            "\r\nINCT").encode(), False


@FUZZ
@given(request=requests())
@example(request=_cut("/infer/suffix?k=x"))
@example(request=_cut("/infer/full"))
@example(request=(b"GET /health HTTP/1.1\r\nHost: x\r\nX: " + b"y" * 9000 + b"\r\n\r\n", True))
def test_any_request_gets_a_4xx_at_worst_and_the_server_keeps_serving(server, request, caplog):
    data, complete = request
    caplog.clear()  # one test call runs every example
    with caplog.at_level(logging.INFO):
        reply = _send_raw(server.port, data, complete)
    if complete:
        assert reply, "a complete request got no answer"
    if reply:  # an incomplete request may get its connection closed instead
        status_line = reply.split(b"\r\n", 1)[0]
        assert status_line.startswith(b"HTTP/1."), status_line[:80]
        statuses = [int(line.split()[1]) for line in reply.split(b"\r\n") if line.startswith(b"HTTP/1.")]
        assert all(100 <= s < 500 for s in statuses), (statuses, reply[:300])
    # no handler raised (a 500, even when the client had gone), and nothing parse errors log is a traceback
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], [caplog.text]
    _good_request(server.port)
