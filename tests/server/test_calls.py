"""The call core under a second front: plain Python messages, no protobuf, no gRPC types.

A front is a translator (vaed.calls): these tests drive a real server's CallCore with
tensors as messages and compare what comes out with what the gRPC front sends.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
import torch

from vaed.calls import CallEnd, CallFailed, CallInput, FramesOut, InputMessage, RequestedOutput
from vaed.errors import Status
from vaed_client import VaeClient

from harness import make_config, serve_in_thread

Z = 4  # random:wan2.1-tiny


class TensorLatents:
    """Latents as a plain tensor: the header is its shape, the copy a clone."""

    def __init__(self, latents: torch.Tensor) -> None:
        self.latents = latents

    def header(self) -> tuple[tuple[int, ...], torch.dtype]:
        return tuple(self.latents.shape), self.latents.dtype

    def to_tensor(self) -> torch.Tensor:
        return self.latents.clone()


RAW = RequestedOutput(rgb8=False, raw_dtype=torch.float32)


def plain_input(chunks: list[torch.Tensor], options: RequestedOutput | None = RAW) -> tuple[CallInput[Any], list[int]]:
    """A front that reads its messages from a list; it counts how many the core parsed."""
    pending = list(chunks)
    parsed: list[int] = []

    async def receive() -> torch.Tensor | None:
        return pending.pop(0) if pending else None

    def parse(latents: torch.Tensor) -> InputMessage:
        parsed.append(1)
        first = len(parsed) == 1
        return InputMessage("plain", TensorLatents(latents), (lambda: options) if first and options else None)

    return CallInput(receive, parse), parsed


def run_call(running: Any, make_call: Any) -> list[Any]:
    async def collect() -> list[Any]:
        call = make_call()
        try:
            return [item async for item in call]
        finally:
            await call.aclose()

    return asyncio.run_coroutine_threadsafe(collect(), running.loop).result(120)


@pytest.fixture(scope="module")
def running() -> Any:
    with serve_in_thread(make_config()) as running:
        yield running


def test_a_second_front_gets_the_grpc_fronts_frames(running: Any) -> None:
    latents = torch.randn(1, Z, 3, 4, 6)
    core = running.server.core
    stream_in, parsed = plain_input([latents[:, :, :1], latents[:, :, 1:]])
    items = run_call(running, lambda: core.decode_stream(stream_in, lambda item: item, lambda: False))
    assert parsed == [1, 1]
    end = items[-1]
    assert isinstance(end, CallEnd) and end.request_id == "plain" and (end.groups, end.frames) == (3, 9)
    pieces = items[:-1]
    assert all(isinstance(p, FramesOut) for p in pieces)
    assert [p.first_frame for p in pieces] == [0, 1, 5]
    frames = torch.cat([p.frames for p in pieces], dim=2)
    with VaeClient(running.target) as client:
        via_grpc = client.decode(latents, output_type="raw", raw_dtype="float32")
    assert torch.equal(frames, torch.as_tensor(via_grpc))

    decode_in, _ = plain_input([latents])
    items = run_call(running, lambda: core.decode(decode_in, lambda item: item, lambda: False))
    assert torch.equal(torch.cat([p.frames for p in items[:-1]], dim=2), frames)


def test_a_failure_is_one_status_and_a_second_decode_message_is_never_parsed(running: Any) -> None:
    core = running.server.core
    decode_in, parsed = plain_input([torch.randn(1, Z, 1, 4, 6), torch.randn(1, Z, 1, 4, 6)])
    with pytest.raises(CallFailed) as failed:
        run_call(running, lambda: core.decode(decode_in, lambda item: item, lambda: False))
    assert failed.value.status is Status.INVALID_ARGUMENT and "exactly one" in failed.value.message
    assert parsed == [1]  # refused without parsing it

    bad_in, _ = plain_input([torch.randn(1, Z + 1, 1, 4, 6)])
    with pytest.raises(CallFailed) as failed:
        run_call(running, lambda: core.decode_stream(bad_in, lambda item: item, lambda: False))
    assert failed.value.status is Status.INVALID_ARGUMENT and "z_dim" in failed.value.message


def test_a_refused_call_lets_go_of_its_message_without_a_garbage_collection(running: Any) -> None:
    """A refused message is freed when its call ends, not at a later garbage collection: the
    failure raised inside its except clause carried the refusal as its context, whose traceback
    held the body's frames and the message (a 64 MiB Decode over --max-pixels grew the server's
    RSS by ~200 MB a call, 2 GB after seven, until a collection ran)."""
    import gc
    import weakref

    core = running.server.core
    for make in (core.decode_stream, core.decode):
        bad = torch.randn(1, Z + 1, 1, 4, 6)  # a z_dim the model does not have
        message = weakref.ref(bad)
        bad_in, _ = plain_input([bad])
        del bad
        gc.disable()
        try:
            with pytest.raises(CallFailed) as failed:
                run_call(running, lambda: make(bad_in, lambda item: item, lambda: False))  # noqa: B023
            assert failed.value.status is Status.INVALID_ARGUMENT and "z_dim" in failed.value.message
            del failed
            assert message() is None, make.__name__
        finally:
            gc.enable()


def test_every_status_is_a_grpc_code_and_an_http_status() -> None:
    for status in Status:
        assert grpc.StatusCode[status.name].name == status.name
        assert 200 <= status.value < 600
