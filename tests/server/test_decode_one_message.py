"""Decode is unary on the wire contract: a client that streams a second DecodeRequest
on it is refused with INVALID_ARGUMENT (gRPC alone would ignore the extra message).
Raw stream-stream calls on the Decode method, through the real wire."""

from __future__ import annotations

import grpc
import pytest
import torch

from vaed_client import wire


DECODE = f"/{wire.SERVICE_NAME}/Decode"


def _request(t: int) -> bytes:
    latents = torch.randn(1, 4, t, 5, 7)
    return wire.pb.DecodeRequest(latents=wire.to_message(latents)).SerializeToString()


def _call(target: str, messages: list[bytes]) -> list[wire.pb.FrameChunk]:
    with grpc.insecure_channel(target) as channel:
        call = channel.stream_stream(DECODE, request_serializer=None, response_deserializer=wire.pb.FrameChunk.FromString)
        return list(call(iter(messages), timeout=60))


def test_one_message_on_a_streaming_call_decodes(tiny_server):
    replies = _call(tiny_server.target, [_request(2)])
    assert replies[-1].final and replies[-1].first_frame == 5


@pytest.mark.parametrize("second_t", [1, 0])
def test_a_second_message_is_invalid_argument(tiny_server, second_t):
    second = _request(second_t) if second_t else b""  # an empty message is still a message
    with pytest.raises(grpc.RpcError) as info:
        _call(tiny_server.target, [_request(2), second])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exactly one DecodeRequest" in info.value.details()
