"""Offload server + client: wire codec, full / cached / suffix inference, profile, security, isolation, netem."""

from __future__ import annotations

import http.client
import json
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from incrinf.graph import split_points
from incrinf.models import sample_image
from incrinf.normalization import Normalization
from incrinf.offload import wire
from incrinf.offload.client import OffloadClient, ReferenceMismatch, RemoteError, ServerUnavailable, SessionLost
from incrinf.offload.server import ModelService, OffloadServer, SessionNotFound, SessionStore
from incrinf.offload.session import ChangedPixelsUplink
from incrinf.stream.config import StreamConfig
from incrinf.testing.shaping import ShapingProxy
from incrinf.testing.synthetic import synthetic_camera

TOKEN = "correct horse battery staple"
SIZE = 96
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class TinyNet(nn.Module):
    """Convs, a residual add (no split inside it) and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.stem(x))
        x = x + torch.relu(self.a(x))
        x = torch.relu(self.b(x))
        return self.fc(torch.flatten(self.pool(x), 1))


def tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return TinyNet().eval()


@pytest.fixture(scope="module")
def service() -> ModelService:
    return ModelService(tiny_model(), (3, SIZE, SIZE), name="tiny", mean=MEAN, std=STD, timing_repeats=2)


@pytest.fixture(scope="module")
def server(service: ModelService):
    srv = OffloadServer(service, token=TOKEN, max_request_bytes=200_000).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def frames() -> list[np.ndarray]:
    return [f for f, _ in synthetic_camera(sample_image(), 8, size=(SIZE, SIZE), motion="pan", insert_object=True)]


def reference(frame: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return tiny_model()(Normalization(MEAN, STD).tensor(frame)).numpy()


def raw(server: OffloadServer, method: str, path: str, body: bytes | None = None,
        headers: dict | None = None) -> tuple[int, dict]:
    """One request on a fresh connection; returns (status, JSON body or {})."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, {}
    finally:
        conn.close()


# --- codec ---------------------------------------------------------------------------------------------


def test_codec_round_trip_keeps_dtype_shape_and_values():
    tensors = {
        "u8": np.arange(24, dtype=np.uint8).reshape(2, 3, 4),
        "f32": torch.randn(1, 3, 5, 5),
        "f64": np.eye(3),
        "i32": np.zeros((0, 4), dtype=np.int32),
        "big_endian": np.arange(4, dtype=">f4"),
    }
    msg = wire.decode(wire.encode(tensors, {"frame_id": 7, "name": "x"}))
    assert msg.meta == {"frame_id": 7, "name": "x"}
    assert msg.tensors["u8"].dtype == np.uint8 and msg.tensors["u8"].shape == (2, 3, 4)
    np.testing.assert_array_equal(msg.tensors["f32"], tensors["f32"].numpy())
    np.testing.assert_array_equal(msg.tensors["f64"], np.eye(3))
    assert msg.tensors["i32"].shape == (0, 4)
    np.testing.assert_array_equal(msg.tensors["big_endian"], np.arange(4, dtype=np.float32))
    assert msg.tensors["u8"].flags.writeable


@pytest.mark.parametrize("mutate, message", [
    (lambda b: b"XXXX" + b[4:], "bad magic"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\0", "trailing"),
    (lambda b: b[:10], "truncated"),
])
def test_codec_rejects_malformed(mutate, message):
    good = wire.encode({"frame": np.zeros((4, 4, 3), np.uint8)}, {"frame_id": 1})
    with pytest.raises(wire.PayloadError, match=message):
        wire.decode(mutate(good))


def test_codec_rejects_lying_sizes():
    good = bytearray(wire.encode({"t": np.zeros(4, np.float32)}))
    good[-16 - 8] += 1  # the u64 nbytes field of the only tensor
    with pytest.raises(wire.PayloadError, match="does not match"):
        wire.decode(bytes(good))


def test_codec_rejects_huge_empty_shapes():
    import struct

    body = wire.MAGIC + struct.pack("<I", 2) + b"{}" + struct.pack("<H", 1) + struct.pack("<B", 1) + b"t"
    body += struct.pack("<BB", 1, 3) + struct.pack("<3I", 0, 2**32 - 1, 2**32 - 1) + struct.pack("<Q", 0)
    with pytest.raises(wire.PayloadError, match="too large"):
        wire.decode(body)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 120))
def test_codec_fuzz_only_raises_payload_error(noise, cut):
    good = wire.encode({"a": np.arange(6, dtype=np.int16).reshape(2, 3), "b": np.ones(3)}, {"k": 1})
    for data in (good[:cut] + noise, noise, good[:cut] + noise + good[cut:]):
        try:
            wire.decode(data)
        except wire.PayloadError:
            pass


def test_apply_update_equals_client_mirror(frames):
    uplink = ChangedPixelsUplink(StreamConfig(pixel_threshold=0.0, max_ratio=1.0))
    server_copy = None
    deltas = 0
    for i, frame in enumerate(frames):
        update = uplink.prepare(frame, i)
        server_copy = frame.copy() if update.full else wire.apply_update(server_copy, update.matrix, update.boxes,
                                                                         update.tiles)
        deltas += not update.full
        uplink.commit(update, i)
        np.testing.assert_array_equal(server_copy, update.reference)
        np.testing.assert_array_equal(server_copy, frame)  # threshold 0: every changed pixel is sent
    assert deltas > 0


def test_apply_update_rejects_bad_boxes():
    ref = np.zeros((8, 8, 3), np.uint8)
    with pytest.raises(wire.PayloadError, match="boxes"):
        wire.apply_update(ref, None, np.array([[0, 9, 0, 4]], np.int32), np.zeros(9 * 4 * 3, np.uint8))
    with pytest.raises(wire.PayloadError, match="tiles hold"):
        wire.apply_update(ref, None, np.array([[0, 2, 0, 2]], np.int32), np.zeros(5, np.uint8))
    with pytest.raises(wire.PayloadError, match="invertible"):
        wire.apply_update(ref, np.zeros((3, 3)), np.zeros((0, 4), np.int32), np.zeros(0, np.uint8))


# --- inference ------------------------------------------------------------------------------------------


def test_full_inference_matches_local(server, frames):
    client = OffloadClient(server.url, TOKEN)
    for frame in frames[:3]:
        reply = client.infer_full(frame)
        np.testing.assert_allclose(reply.output, reference(frame), rtol=1e-5, atol=1e-6)
        assert reply.server_seconds > 0
    x = Normalization(MEAN, STD).tensor(frames[0]).numpy()
    np.testing.assert_allclose(client.infer_full(x).output, reference(frames[0]), rtol=1e-5, atol=1e-6)
    client.close()


def test_suffix_at_every_split_matches_full(server, service, frames):
    client = OffloadClient(server.url, TOKEN)
    x = Normalization(MEAN, STD).tensor(frames[1])
    splits = split_points(service.graph)
    names = {s.name for s in splits}
    # Inside the residual block two tensors are live: no split there; after the add, one.
    assert "a" not in names and "relu_1" not in names
    assert {"relu", "add", "b", "flatten"} <= names
    for split in splits:
        tensor = service.runner.prefix(x, split.name)
        assert tuple(tensor.shape) == split.shape
        out = client.infer_suffix(split.name, tensor.numpy()).output
        np.testing.assert_allclose(out, reference(frames[1]), rtol=1e-5, atol=1e-6)
    client.close()


def test_cached_stream_reconstructs_and_matches_reference(server, frames):
    client = OffloadClient(server.url, TOKEN)
    session = client.open_session()
    uplink = ChangedPixelsUplink(StreamConfig(pixel_threshold=10.0))
    deltas = 0
    for i, frame in enumerate(frames):
        update = uplink.prepare(frame, i)
        if update.full:
            reply = client.infer_full(frame, session, i)
        else:
            reply = client.infer_cached(session, uplink.reference_id, i, update.matrix, update.boxes, update.tiles)
            deltas += 1
            assert reply.bytes_up < frame.nbytes  # only the changed tiles went up
        uplink.commit(update, i)
        assert reply.digest == wire.frame_digest(update.reference)
        np.testing.assert_allclose(reply.output, reference(update.reference), rtol=1e-5, atol=1e-6)
    assert deltas >= len(frames) // 2
    client.close()


def test_cached_with_stale_base_is_409(server, frames):
    client = OffloadClient(server.url, TOKEN)
    session = client.open_session()
    client.infer_full(frames[0], session, 0)
    with pytest.raises(ReferenceMismatch):
        client.infer_cached(session, 5, 6, np.eye(3), np.zeros((0, 4), np.int32), np.zeros(0, np.uint8))
    client.close()


def test_profile_reports_every_node(server, service):
    client = OffloadClient(server.url, TOKEN)
    info = client.profile()
    assert info["signature"] == service.graph.signature and info["digest"] == service.digest
    names = info["profile"]["names"]
    assert names == [n.name for n in service.graph.nodes]
    seconds = np.array(info["profile"]["seconds"])
    assert np.all(seconds >= 0) and seconds.sum() == pytest.approx(info["profile"]["full_seconds"], rel=1e-6)
    assert {s["name"] for s in info["splits"]} == {s.name for s in split_points(service.graph)}
    client.close()


# --- security -------------------------------------------------------------------------------------------


def test_token_required_when_set(server, frames):
    body = wire.encode({"frame": frames[0]})
    assert raw(server, "GET", "/health")[0] == 200  # liveness stays open
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
        assert raw(server, "GET", "/profile", headers=headers)[0] == 401
        status, js = raw(server, "POST", "/infer/full", body, headers)
        assert status == 401 and "token" in js["error"]
        assert raw(server, "POST", "/session", b"", headers)[0] == 401
    with pytest.raises(RemoteError) as info:
        OffloadClient(server.url, token=None).infer_full(frames[0])
    assert info.value.status == 401
    assert raw(server, "GET", "/profile", headers={"Authorization": f"Bearer {TOKEN}"})[0] == 200


def test_client_cannot_address_another_clients_cache(server, frames):
    alice, mallory = OffloadClient(server.url, TOKEN), OffloadClient(server.url, TOKEN)
    alice_session = alice.open_session()
    alice.infer_full(frames[0], alice_session, 0)
    # Session ids are random capabilities: a guessed or foreign id is unknown.
    for guess in ("0", "alice", alice_session[:-1] + ("A" if alice_session[-1] != "A" else "B")):
        with pytest.raises(SessionLost):
            mallory.infer_cached(guess, 0, 1, np.eye(3), np.zeros((0, 4), np.int32), np.zeros(0, np.uint8))
        with pytest.raises(SessionLost):
            mallory.infer_full(frames[3], guess, 1)
    # Mallory's own stream does not touch Alice's reference.
    mallory_session = mallory.open_session()
    assert mallory_session != alice_session
    mallory.infer_full(frames[5], mallory_session, 0)
    reply = alice.infer_cached(alice_session, 0, 1, None, np.zeros((0, 4), np.int32), np.zeros(0, np.uint8))
    assert reply.digest == wire.frame_digest(frames[0])
    np.testing.assert_allclose(reply.output, reference(frames[0]), rtol=1e-5, atol=1e-6)
    alice.close_session(alice_session)
    with pytest.raises(SessionLost):
        alice.infer_cached(alice_session, 1, 2, None, np.zeros((0, 4), np.int32), np.zeros(0, np.uint8))
    alice.close()
    mallory.close()


def test_session_store_keys_by_owner():
    store = SessionStore(max_sessions=2, ttl=60)
    sid = store.create("token:a")
    store.get("token:a", sid)
    with pytest.raises(SessionNotFound):
        store.get("token:b", sid)
    store.create("token:a")
    store.create("token:a")  # evicts the least recently used
    with pytest.raises(SessionNotFound):
        store.get("token:a", sid)
    assert len(store) == 2


def test_malformed_and_oversized_rejected_while_others_are_served(server, frames):
    auth = {"Authorization": f"Bearer {TOKEN}"}
    status, js = raw(server, "POST", "/infer/full", b"not a tensor message", auth)
    assert status == 400 and "bad magic" in js["error"]
    status, js = raw(server, "POST", "/infer/full", wire.encode({"frame": np.zeros((10, 10, 3), np.uint8)}), auth)
    assert status == 400 and "frame must be" in js["error"]
    status, js = raw(server, "POST", "/infer/full", wire.encode({"frame": np.zeros((8,), np.float32)}), auth)
    assert status == 400
    status, js = raw(server, "POST", "/infer/suffix?k=nope", wire.encode({"tensor": np.zeros(3, np.float32)}), auth)
    assert status == 400 and "split" in js["error"]
    status, js = raw(server, "POST", "/infer/full", bytes(300_000), auth)
    assert status == 413 and "exceeds" in js["error"]

    errors: list[BaseException] = []
    served = []
    expected = [reference(frame) for frame in frames]  # seeded model construction: not in threads

    def good_client() -> None:
        client = OffloadClient(server.url, TOKEN)
        try:
            for frame, ref in zip(frames, expected):
                out = client.infer_full(frame).output
                np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)
                served.append(1)
        except BaseException as exc:  # surfaced in the main thread
            errors.append(exc)
        finally:
            client.close()

    def bad_client(kind: int) -> None:
        try:
            bodies = [b"\x00" * 50, bytes(300_000), wire.encode({"frame": np.zeros((3, 3, 3), np.uint8)})]
            for i in range(6):
                body = bodies[(i + kind) % 3]
                status, _ = raw(server, "POST", "/infer/full", body, auth)
                assert status in (400, 413), status
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=good_client) for _ in range(2)]
    threads += [threading.Thread(target=bad_client, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(served) == 2 * len(frames)
    assert raw(server, "GET", "/health")[1]["status"] == "ok"


def test_port_in_use_is_reported_and_a_server_restarts(server, service):
    with pytest.raises(OSError, match="cannot serve"):
        OffloadServer(service, port=server.port).start()
    other = OffloadServer(service).start()
    other.stop()
    other.start()  # the same instance serves again after a stop
    assert OffloadClient(other.url).health()["status"] == "ok"
    other.stop()


# --- network emulation ----------------------------------------------------------------------------------


def test_shaping_proxy_rate_and_latency(server):
    with ShapingProxy(server.port) as proxy:
        client = OffloadClient(f"http://127.0.0.1:{proxy.port}", TOKEN)
        client.health()  # connect
        proxy.set_link(8.0, 20.0)  # 1 MB/s, 40 ms round trip
        t0 = time.perf_counter()
        client.probe(100_000)
        slow = time.perf_counter() - t0
        assert 0.1 + 0.04 <= slow < 0.6, slow  # 100 kB at 1 MB/s plus the round trip
        proxy.set_link(400.0, 0.0)
        t0 = time.perf_counter()
        client.probe(100_000)
        fast = time.perf_counter() - t0
        assert fast < slow / 2
        client.close()


def test_shaping_proxy_replays_trace():
    proxy = ShapingProxy(1, trace=[(0.5, 1.0, 10.0), (0.5, 100.0, 1.0)])
    t0 = time.monotonic()
    proxy._t0 = t0
    assert proxy.link(t0 + 0.1).mbit_per_s == 1.0
    assert proxy.link(t0 + 0.7).mbit_per_s == 100.0
    assert proxy.link(t0 + 5.0).mbit_per_s == 100.0  # the last segment holds
    proxy.loop = True
    assert proxy.link(t0 + 1.2).mbit_per_s == 1.0


def test_a_stop_requested_before_serving_ends_serve_forever(service):
    """SIGTERM can arrive between start-up and serve_forever (the CLI's handler calls request_stop): the
    request is kept, serve_forever returns at once and the port is closed."""
    server = OffloadServer(service).start()
    url = server.url
    assert OffloadClient(url).health()["model"] == "tiny"
    server.request_stop()
    done = threading.Thread(target=server.serve_forever)
    done.start()
    done.join(10)
    assert not done.is_alive()
    with pytest.raises(ServerUnavailable):
        OffloadClient(url, timeout=1.0).health()
