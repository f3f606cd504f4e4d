"""DecodeOptions.skip_frames: the server decodes every latent frame (the causal cache needs
them) but sends only the frames from `skip_frames` on, so a client resuming a call on another
replica gets exactly the frames it lacks, bit-identical to an undisturbed call's. Raw calls
through the real wire against an in-process tiny server with metrics."""

from __future__ import annotations

import grpc
import pytest
import torch

from vaed_client import wire

from harness import make_config, serve_in_thread

Z = 4  # wan2.1-tiny's latent channels
LATENT_FRAMES = 3  # -> 1 + 4 + 4 = 9 output frames: groups of 1, 4 and 4 frames
FRAMES = wire.output_frames(LATENT_FRAMES)


def _raw_options(skip: int) -> wire.pb.DecodeOptions:
    return wire.pb.DecodeOptions(format=wire.pb.RAW, raw_dtype=wire.pb.FLOAT32, skip_frames=skip)


def _frames(replies: list[wire.pb.FrameChunk]) -> tuple[list[int], torch.Tensor | None]:
    """(first_frame of each frame message, the frames joined on the time axis [B, C, T, H, W])."""
    parts = [r for r in replies if not r.final]
    if not parts:
        return [], None
    return [r.first_frame for r in parts], torch.cat([wire.to_torch(r.frames) for r in parts], dim=2)


def _decode(target: str, latents: torch.Tensor, skip: int) -> list[wire.pb.FrameChunk]:
    with grpc.insecure_channel(target) as channel:
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        request = wire.pb.DecodeRequest(latents=wire.to_message(latents), options=_raw_options(skip))
        return list(stub.Decode(request, timeout=120))


def _stream(target: str, latents: torch.Tensor, skip: int) -> list[wire.pb.FrameChunk]:
    """One latent frame per message; the first carries the options."""
    messages = [wire.pb.LatentChunk(latents=wire.to_message(latents[:, :, t:t + 1])) for t in range(latents.shape[2])]
    messages[0].options.CopyFrom(_raw_options(skip))
    with grpc.insecure_channel(target) as channel:
        stub = wire.pb_grpc.VaeDecoderStub(channel)
        return list(stub.DecodeStream(iter(messages), timeout=120))


@pytest.fixture(scope="module")
def server():
    with serve_in_thread(make_config(metrics_port=0)) as running:
        yield running


def _counters(server) -> dict[str, float]:
    registry = server.server.metrics.registry
    names = ("vaed_skipped_frames_total", "vaed_frames_decoded_total", "vaed_latent_frames_decoded_total")
    return {name: registry.get_sample_value(name) for name in names}


@pytest.fixture(scope="module")
def latents() -> torch.Tensor:
    return torch.randn(1, Z, LATENT_FRAMES, 5, 7, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("call", [_decode, _stream], ids=["Decode", "DecodeStream"])
@pytest.mark.parametrize("skip", [1, 3, 5, FRAMES - 1, FRAMES, FRAMES + 4])
def test_skipped_frames_are_not_sent_and_the_rest_equal_an_undisturbed_call(server, latents, call, skip):
    full = call(server.target, latents, 0)
    starts, whole = _frames(full)
    assert whole is not None and whole.shape[2] == FRAMES and starts[0] == 0

    before = _counters(server)
    replies = call(server.target, latents, skip)
    after = _counters(server)
    starts, rest = _frames(replies)
    if skip >= FRAMES:
        assert rest is None  # nothing left to send: only the final message
    else:
        assert starts[0] == skip  # a group across the boundary starts at the first frame not skipped
        assert torch.equal(rest, whole[:, :, skip:])
    final = replies[-1]
    assert final.final and sum(r.final for r in replies) == 1
    # the final message counts the whole video, skipped frames included, like an undisturbed call's
    assert (final.chunk_index, final.first_frame) == (full[-1].chunk_index, full[-1].first_frame) == (LATENT_FRAMES, FRAMES)
    moved = {name: after[name] - before[name] for name in after}
    skipped = min(skip, FRAMES)
    assert moved == {"vaed_skipped_frames_total": skipped, "vaed_frames_decoded_total": FRAMES - skipped,
                     "vaed_latent_frames_decoded_total": LATENT_FRAMES}  # every latent frame was decoded
