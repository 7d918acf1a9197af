"""OffloadConfig: frozen, validated, built from keywords (its own fields and the stream settings); the session's
keyword form, renamed names and the default normalisation."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import tiny_classifier

from incrinf.normalization import FRAME_MEAN, FRAME_STD, IMAGENET_MEAN, IMAGENET_STD
from incrinf.offload.config import OffloadConfig
from incrinf.offload.policy import Policy
from incrinf.offload.session import OffloadingSession
from incrinf.stream.config import StreamConfig

URL = "http://127.0.0.1:8765"
NOBODY = "http://127.0.0.1:9"  # the discard port: nothing listens, connections are refused at once


def test_defaults_and_frozen() -> None:
    config = OffloadConfig()
    assert config.policy is Policy.AUTO and config.offload is None and config.stream == StreamConfig()
    assert config.deciding
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.budget = 1.0  # type: ignore[misc]


def test_values_are_normalised() -> None:
    config = OffloadConfig(URL, "hybrid", split="conv", input_size=[96, 128], mean=[0.5, 0.5, 0.5], std=(1, 1, 1),
                           lookahead=5, max_timeout=1)
    assert config.policy is Policy.HYBRID and not config.deciding
    assert config.input_size == (96, 128) and config.mean == (0.5, 0.5, 0.5) and config.std == (1.0, 1.0, 1.0)
    assert isinstance(config.max_timeout, float)


def test_the_token_is_never_printed() -> None:
    config = OffloadConfig(URL, token="s3cret-token")
    assert "s3cret" not in repr(config) and config.token == "s3cret-token"


@pytest.mark.parametrize("settings, message", [
    ({"offload": "ftp://host:1"}, "http://host:port"),
    ({"offload": "http://host:99999"}, "bad port"),
    ({"offload": 8765}, "URL string"),
    ({"policy": "teleport"}, "unknown policy"),
    ({"policy": "offload_full"}, "needs a server"),
    ({"offload": URL, "policy": "offload_cached"}, "offload_changed_pixels"),
    ({"offload": URL, "policy": "hybrid:conv"}, "split='conv'"),
    ({"offload": URL, "policy": "offload_full", "split": "conv"}, "hybrid policy's split node"),
    ({"offload": URL, "policy": "hybrid", "split": ""}, "node name"),
    ({"offload": URL, "token": " padded "}, "token"),
    ({"offload": URL, "ca_file": "ca.pem"}, "https"),
    ({"verify": "yes"}, "verify"),
    ({"input_size": (96,)}, "input_size"),
    ({"input_size": (96, 0)}, "input_size"),
    ({"input_size": (96.5, 96)}, "input_size"),
    ({"mean": ()}, "mean"),
    ({"mean": (0.5, float("nan"), 0.5)}, "mean"),
    ({"std": (0.5, 0.0, 0.5)}, "std must be positive"),
    ({"mean": (0.5,) * 3, "std": (0.5,)}, "same number of channels"),
    ({"budget": 0}, "budget"),
    ({"budget": float("inf")}, "budget"),
    ({"max_timeout": 0}, "max_timeout"),
    ({"local_slowdown": 0.5}, "local_slowdown"),
    ({"lookahead": 0}, "lookahead"),
    ({"lookahead": 2.5}, "lookahead"),
    ({"margin": -0.1}, "margin"),
    ({"backoff_initial": 0}, "backoff_initial"),
    ({"backoff_initial": 1.0, "backoff_cap": 0.5}, "backoff_cap"),
    ({"probe_interval": -1}, "probe_interval"),
    ({"max_splits": -1}, "max_splits"),
    ({"timing_repeats": 0}, "timing_repeats"),
    ({"keep_stats": 0}, "keep_stats"),
    ({"keep_stats": True}, "keep_stats"),
    ({"stream": {"pixel_threshold": 5}}, "StreamConfig"),
])
def test_bad_values_are_clear_errors(settings, message) -> None:
    with pytest.raises(ValueError, match=message):
        OffloadConfig(**settings)


def test_build_routes_stream_settings_and_rejects_unknown_ones() -> None:
    config = OffloadConfig.build(None, offload=URL, policy="offload_changed_pixels", pixel_threshold=5, max_ratio=1.0,
                                 budget=0.25)
    assert config.policy is Policy.OFFLOAD_CHANGED_PIXELS and config.budget == 0.25
    assert config.stream.pixel_threshold == 5 and config.stream.max_ratio == 1.0
    again = OffloadConfig.build(config, pixel_threshold=7)  # one stream field replaced, the others kept
    assert again.stream.pixel_threshold == 7 and again.stream.max_ratio == 1.0 and again.budget == 0.25
    as_stream = OffloadConfig.build(StreamConfig(cell=8))  # a StreamConfig is the stream settings (older form)
    assert as_stream.stream.cell == 8 and as_stream.policy is Policy.AUTO
    with pytest.raises(TypeError, match="unknown offload setting.*treshold"):
        OffloadConfig.build(None, treshold=5)
    with pytest.raises(TypeError, match="OffloadConfig"):
        OffloadConfig.build({"budget": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pixel_threshold"):
        OffloadConfig.build(None, pixel_threshold=-1)
    with pytest.warns(DeprecationWarning, match="timing_repeats"):
        assert OffloadConfig.build(None, profile_repeats=2).timing_repeats == 2


def test_session_keyword_form_and_config_form_agree() -> None:
    size = 48
    old = OffloadingSession(tiny_classifier(), None, "local_cached", input_size=(size, size), timing_repeats=1,
                            pixel_threshold=0.0, keep_stats=4)
    new = OffloadingSession(tiny_classifier(), config=OffloadConfig(policy=Policy.LOCAL_CACHED, input_size=(size, size),
                                                                    timing_repeats=1, keep_stats=4,
                                                                    stream=StreamConfig(pixel_threshold=0.0)))
    assert old.config == new.config
    old.close()
    new.close()


def test_session_errors_name_the_new_form() -> None:
    with pytest.raises(ValueError, match="offload_changed_pixels"):
        OffloadingSession(tiny_classifier(), URL, "offload_cached", input_size=(48, 48))
    with pytest.raises(ValueError, match="policy='hybrid', split='relu'"):
        OffloadingSession(tiny_classifier(), URL, "hybrid:relu", input_size=(48, 48))
    with pytest.raises(TypeError, match="unknown offload setting"):
        OffloadingSession(tiny_classifier(), None, input_size=(48, 48), polcy="auto")
    with pytest.raises(TypeError, match="torch.nn.Module"):
        OffloadingSession(object(), None, input_size=(48, 48))  # type: ignore[arg-type]


def test_a_split_node_the_model_lacks_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'no_such_node' is not a split point of the model; choose one of"):
        OffloadingSession(tiny_classifier(), NOBODY, "hybrid", split="no_such_node", input_size=(48, 48),
                          timing_repeats=1, max_timeout=0.5)


def test_default_normalisation_agrees_with_stream_sessions() -> None:
    from incrinf.offload.server import ModelService
    from incrinf.stream.session import StreamSession

    session = OffloadingSession(tiny_classifier(), None, input_size=(48, 48), timing_repeats=1)
    stream = StreamSession(tiny_classifier())
    assert session.normalization == stream.normalization
    assert (session.mean, session.std) == (FRAME_MEAN, FRAME_STD)
    service = ModelService(tiny_classifier(), (3, 48, 48), timing_repeats=1)
    assert (service.mean, service.std) == (FRAME_MEAN, FRAME_STD)
    zoo = OffloadingSession("resnet18", None, input_size=(64, 64), timing_repeats=1)
    assert (zoo.mean, zoo.std) == (IMAGENET_MEAN, IMAGENET_STD)  # a model given by name: the zoo entry's
    given = OffloadingSession(tiny_classifier(), None, input_size=(48, 48), timing_repeats=1,
                              mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    frame = torch.zeros(48, 48, 3, dtype=torch.uint8).numpy()
    assert given(frame).shape == session(frame).shape
    assert given.normalization.mean == (0.485, 0.456, 0.406)
    for s in (session, zoo, given):
        s.close()
