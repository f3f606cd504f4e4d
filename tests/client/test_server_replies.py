"""What the client makes of replies a vaed server never sends (a buggy or hostile server, a proxy
that mangles them): each is an InternalError naming what came, never a bare IndexError or
ValueError from inside the client, nor a video of another length than the latents decode to.
And a newer server's enum values do not break an older client's model_info()."""

from __future__ import annotations

import re

import numpy as np
import pytest

from vaed_client import wire
from vaed_client.core import ModelInfo
from vaed_client.encoding import EncodedAssembly
from vaed_client.errors import InternalError
from vaed_client.resume import CallReport, Progress, ResumePolicy, Targets
from vaed_client.video import VideoAssembler

pb = wire.pb


def _chunk(frames: np.ndarray, first: int = 0) -> pb.FrameChunk:
    return pb.FrameChunk(first_frame=first, frames=wire.to_message(frames))


def _rgb8(count: int) -> np.ndarray:
    return np.zeros((1, count, 16, 16, 3), dtype=np.uint8)


@pytest.mark.parametrize("frames, why", [
    (np.zeros(10, dtype=np.uint8), "shape [10]"),
    (np.zeros((1, 0, 16, 16, 3), dtype=np.uint8), "shape [1, 0, 16, 16, 3]"),
    (np.zeros((1, 2, 16, 16, 3), dtype=np.float32), "in float32"),
])
def test_frames_of_another_layout_are_an_internal_error_before_they_are_counted(frames: np.ndarray,
                                                                                why: str) -> None:
    progress = Progress(ResumePolicy(), Targets(["a:1"]), CallReport(), None, "rid")
    with pytest.raises(InternalError, match=re.escape(why)) as caught:
        progress.accept(_chunk(frames), "rgb8")
    assert "not a rgb8 layout" in str(caught.value)
    assert progress.delivered == 0
    with pytest.raises(InternalError, match="not a rgb8 layout"):
        VideoAssembler("rgb8", expected_frames=9).add(_chunk(frames))


@pytest.mark.parametrize("sent", [5, 13])
def test_a_video_of_another_length_than_the_latents_decode_to_is_an_internal_error(sent: int) -> None:
    assembler = VideoAssembler("rgb8", expected_frames=9)
    assembler.add(_chunk(_rgb8(sent)))
    with pytest.raises(InternalError, match=f"decode to 9 frames, and the server sent {sent}"):
        assembler.result(as_torch=False)
    whole = VideoAssembler("rgb8", expected_frames=9)
    whole.add(_chunk(_rgb8(1)))
    whole.add(_chunk(_rgb8(8), first=1))
    assert whole.result(as_torch=False).shape == (1, 9, 16, 16, 3)


def test_enum_values_this_client_does_not_know_are_named_unknown() -> None:
    info = ModelInfo.from_proto(pb.ModelInfo(model="m", z_dim=16, precisions=[pb.LOSSLESS, 99],
                                             encode_precisions=[98], video_formats=[pb.MP4, 97]))
    assert info.precisions == ["lossless", "unknown(99)"] and info.encode_precisions == ["unknown(98)"]
    assert info.video_formats == ["mp4", "unknown(97)"]


@pytest.mark.parametrize("field, value", [("scale_factor_temporal", 10**6), ("scale_factor_temporal", 2**32 - 1),
                                          ("scale_factor_spatial", 65)])
def test_a_scale_factor_no_vae_has_is_an_internal_error_before_anything_is_sized_by_it(field: str,
                                                                                      value: int) -> None:
    message = pb.ModelInfo(model="m", z_dim=16, scale_factor_temporal=4, scale_factor_spatial=8)
    setattr(message, field, value)
    with pytest.raises(InternalError, match=f"{field} {value}, which no VAE has"):
        ModelInfo.from_proto(message)
    setattr(message, field, 64)  # the largest taken; 0 (not set) means Wan's
    assert getattr(ModelInfo.from_proto(message), field) == 64
    unset = ModelInfo.from_proto(pb.ModelInfo(model="m", z_dim=16))
    assert unset.output_frames(3) == 9


def _moments(frames: int, z: int = 8, dtype: type = np.float32) -> pb.LatentFrameChunk:
    return pb.LatentFrameChunk(moments=wire.to_message(np.zeros((1, z, frames, 2, 2), dtype=dtype)))


def test_encode_replies_are_one_latent_frame_each_and_as_many_as_the_frames_encode_to() -> None:
    final = pb.LatentFrameChunk(final=True)
    whole = EncodedAssembly("moments", as_torch=False, latent_frames=2)
    for reply in (_moments(1), _moments(1), final):
        whole.add(reply)
    assert whole.result().shape == (1, 8, 2, 2, 2)
    short = EncodedAssembly("moments", as_torch=False, latent_frames=2)
    for reply in (_moments(1), final):
        short.add(reply)
    with pytest.raises(InternalError, match="encode to 2 latent frames, and the server sent 1"):
        short.result()
    for bad, why in [(_moments(5), r"shape \[1, 8, 5, 2, 2\]"), (_moments(1, z=4), r"shape \[1, 4, 1, 2, 2\]"),
                     (_moments(1, dtype=np.float16), "float16")]:
        assembly = EncodedAssembly("moments", as_torch=False, latent_frames=3)
        assembly.add(_moments(1))
        with pytest.raises(InternalError, match=why):
            assembly.add(bad)
    garbled = pb.LatentFrameChunk(moments=pb.Tensor(dtype=pb.FLOAT32, shape=[1, 8, 1, 2, 2], data=b"\0" * 7))
    with pytest.raises(InternalError, match="malformed moments from server"):
        EncodedAssembly("moments", as_torch=False, latent_frames=1).add(garbled)
