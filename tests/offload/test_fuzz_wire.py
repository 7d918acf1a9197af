"""Fuzzing the wire format and the model service behind it: any bytes decode to a consistent message or raise
PayloadError (the server's 400); any message reaching the service gets a result or a payload/session error (a
4xx), never another exception (a 500), and the service then serves a good request exactly."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from incrinf.models import sample_image
from incrinf.normalization import Normalization
from incrinf.offload import wire
from incrinf.offload.server import CacheConflict, ModelService, SessionNotFound
from incrinf.testing.synthetic import synthetic_camera

SIZE = 32
MEAN, STD = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
WIRE_DTYPES = [np.uint8, np.int8, np.int16, np.int32, np.int64, np.float16, np.float32, np.float64, np.bool_]
FAST = settings(max_examples=150, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
SERVICE = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                          HealthCheck.too_slow])

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _meta_values():
    scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                        st.text(max_size=8))
    return st.dictionaries(st.text(max_size=8), st.one_of(scalars, st.lists(scalars, max_size=3)), max_size=4)


@st.composite
def messages(draw) -> tuple[dict[str, np.ndarray], dict]:
    names = draw(st.lists(st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12),
                          max_size=4, unique=True))
    tensors = {name: draw(hnp.arrays(draw(st.sampled_from(WIRE_DTYPES)),
                                     hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=5)))
               for name in names}
    return tensors, draw(_meta_values())


@FAST
@given(messages())
def test_round_trip(message):
    tensors, meta = message
    decoded = wire.decode(wire.encode(tensors, meta))
    assert decoded.meta == meta and sorted(decoded.tensors) == sorted(tensors)
    for name, value in tensors.items():
        got = decoded.tensors[name]
        assert got.dtype == value.dtype.newbyteorder("<") and got.shape == value.shape
        np.testing.assert_array_equal(got, value)


@st.composite
def mutated(draw) -> bytes:
    tensors, meta = draw(messages())
    data = bytearray(wire.encode(tensors, meta))
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(data)))
        kind = draw(st.sampled_from(["flip", "truncate", "insert", "lie"]))
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[at:]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=16))
        elif at + 4 <= len(data):  # a length field that lies
            data[at:at + 4] = struct.pack("<I", draw(st.sampled_from([0, 1, 2**16, 2**31, 2**32 - 1])))
    return bytes(data)


def _deep(meta: bytes) -> bytes:
    return wire.MAGIC + struct.pack("<I", len(meta)) + meta + struct.pack("<H", 0)


@FAST
@given(mutated())
@example(_deep(b"[" * 60000))  # nesting too deep for the JSON parser (was a RecursionError: a 500)
@example(_deep(b'{"frame_id": ' + b"9" * 5000 + b"}"))  # an integer too long to convert (was a ValueError)
@example(b"INCT" + struct.pack("<I", 2) + b"{}" + struct.pack("<H", 1) + b"\x01x\x07\x02"
         + struct.pack("<II", 2**31, 2**31) + struct.pack("<Q", 2**64 - 1))  # a huge claimed tensor
def test_mutated_bytes_decode_or_raise_payload_error(data):
    try:
        message = wire.decode(data)
    except wire.PayloadError as exc:
        assert str(exc)
    else:
        assert isinstance(message.meta, dict)
        assert all(isinstance(v, np.ndarray) and v.flags.writeable for v in message.tensors.values())
        assert sum(v.nbytes for v in message.tensors.values()) <= len(data)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1),
                         nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()


@pytest.fixture(scope="module")
def service() -> ModelService:
    return ModelService(_model(), (3, SIZE, SIZE), mean=MEAN, std=STD, timing_repeats=1)


FRAMES = [f for f, _ in synthetic_camera(sample_image(), 2, size=(SIZE, SIZE), motion="pan")]
with torch.no_grad():
    GOOD_OUTPUT = _model()(Normalization(MEAN, STD).tensor(FRAMES[1])).numpy()


@st.composite
def service_messages(draw) -> wire.Message:
    """Messages aimed at the endpoints: the right tensor names with wrong (or right) dtypes, shapes and values,
    boxes anywhere, matrices of any magnitude, ids of any type."""
    tensors: dict[str, np.ndarray] = {}
    for name in draw(st.lists(st.sampled_from(["frame", "input", "boxes", "tiles", "matrix", "tensor", "other"]),
                              max_size=4, unique=True)):
        if name == "boxes" and draw(st.booleans()):
            tensors[name] = draw(hnp.arrays(np.int32, st.tuples(st.integers(0, 3), st.just(4)),
                                            elements=st.integers(-4, SIZE + 4)))
        elif name == "matrix" and draw(st.booleans()):
            values = st.one_of(st.floats(-2.0, 2.0), st.floats(allow_nan=True, allow_infinity=True))
            tensors[name] = draw(hnp.arrays(np.float64, (3, 3), elements=values))
        elif name == "frame" and draw(st.booleans()):
            tensors[name] = np.full((SIZE, SIZE, 3), draw(st.integers(0, 255)), np.uint8)
        elif name == "tiles" and draw(st.booleans()):
            tensors[name] = np.zeros(draw(st.integers(0, 4 * 4 * 3 * 2)), np.uint8)
        else:
            tensors[name] = draw(hnp.arrays(draw(st.sampled_from(WIRE_DTYPES)),
                                            hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=6)))
    ids = st.one_of(st.integers(-2, 3), st.integers(-2**70, 2**70), st.none(), st.text(max_size=3), st.booleans(),
                    st.floats())
    meta = {key: draw(ids) for key in draw(st.lists(st.sampled_from(["frame_id", "base_id"]), unique=True))}
    return wire.decode(wire.encode(tensors, meta))  # what the server sees after parsing


@SERVICE
@given(message=service_messages(), endpoint=st.sampled_from(["full", "full+session", "cached", "suffix"]))
def test_service_answers_any_message_with_a_result_or_a_4xx_error(service, message, endpoint):
    owner = "token:fuzz"
    session = service.sessions.create(owner)
    service.infer_full(wire.Message({"frame": FRAMES[0]}, {"frame_id": 0}), owner, session)  # a reference
    split = next(iter(service.runner.splits))
    try:
        if endpoint == "full":
            out, _, _ = service.infer_full(message, owner, None)
        elif endpoint == "full+session":
            out, _, _ = service.infer_full(message, owner, session)
        elif endpoint == "cached":
            out, _, _ = service.infer_cached(message, owner, session)
        else:
            out, _ = service.infer_suffix(message, split)
    except (wire.PayloadError, SessionNotFound, CacheConflict) as exc:  # 400, 404, 409
        assert str(exc)
    else:
        assert out.shape == (1, 5)
    # the session's cache still works, and a good frame gives exactly its output
    out, _, _ = service.infer_full(wire.Message({"frame": FRAMES[1]}, {"frame_id": 1}), owner, session)
    np.testing.assert_allclose(out, GOOD_OUTPUT, rtol=1e-5, atol=1e-6)
    service.sessions.delete(owner, session)
