"""vaed_client.wire: the public wire knowledge both ends import (limits,
frames-per-latent rule, chunk splitting, dtype table, tensor validation)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from vaed_client import wire


def test_constants() -> None:
    assert wire.SERVICE_NAME == wire.pb.DESCRIPTOR.services_by_name["VaeDecoder"].full_name == "vaed.v1.VaeDecoder"
    assert set(wire.METHODS) == set(wire.pb.DESCRIPTOR.services_by_name["VaeDecoder"].methods_by_name)
    assert wire.MAX_MESSAGE_BYTES == 256 * 1024 * 1024
    assert wire.FRAME_MESSAGE_BYTES == 16 * 1024 * 1024 < wire.MAX_MESSAGE_BYTES
    assert wire.AUTH_TOKEN_ENV == "VAED_AUTH_TOKEN" and wire.MAX_REQUEST_ID_CHARS == 128
    assert hasattr(wire.pb_grpc, "VaeDecoderStub")


@pytest.mark.parametrize("t, temporal, frames", [(0, 4, 0), (1, 4, 1), (2, 4, 5), (21, 4, 81), (31, 4, 121), (3, 2, 5)])
def test_output_frames(t: int, temporal: int, frames: int) -> None:
    assert wire.output_frames(t, temporal) == frames


def test_output_frames_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="latent_frames"):
        wire.output_frames(-1)
    with pytest.raises(ValueError, match="temporal"):
        wire.output_frames(3, 0)


@pytest.mark.parametrize("count", [0, 1, 4, 5, 9])
@pytest.mark.parametrize("frame_bytes, cap", [(10, 35), (10, 10), (10, 9), (100, 1), (0, 5), (7, 10**9)])
def test_frame_slices_tile_and_respect_the_cap(count: int, frame_bytes: int, cap: int) -> None:
    pieces = wire.frame_slices(count, frame_bytes, cap)
    covered = [i for start, length in pieces for i in range(start, start + length)]
    assert covered == list(range(count))  # every frame once, in order
    assert all(length >= 1 for _, length in pieces)
    for _, length in pieces:  # under the cap, or a single frame that cannot be split
        assert length * frame_bytes <= cap or length == 1
    if frame_bytes and count:
        assert len(pieces) == -(-count // max(1, cap // frame_bytes))  # as few pieces as possible


def test_frame_slices_examples_and_errors() -> None:
    assert wire.frame_slices(9, 10, 35) == [(0, 3), (3, 3), (6, 3)]
    assert wire.frame_slices(4, 5_000_000, 16 * 2**20) == [(0, 3), (3, 1)]
    with pytest.raises(ValueError):
        wire.frame_slices(4, 10, 0)
    with pytest.raises(ValueError):
        wire.frame_slices(-1, 10, 10)


def test_dtype_table_round_trips() -> None:
    assert wire.DTYPE_NAMES == {wire.pb.UINT8: "uint8", wire.pb.FLOAT16: "float16",
                                wire.pb.BFLOAT16: "bfloat16", wire.pb.FLOAT32: "float32"}
    for value, name in wire.DTYPE_NAMES.items():
        assert wire.WIRE_DTYPE_BY_NAME[name] == value == wire.wire_dtype(name) == wire.wire_dtype(value)
        assert wire.wire_dtype(wire.torch_dtype(value)) == value
        assert wire.itemsize(value) == torch.empty(0, dtype=wire.torch_dtype(value)).element_size()
    assert wire.wire_dtype(np.float32) == wire.wire_dtype(np.dtype("float16")) + 2 == wire.pb.FLOAT32
    assert wire.wire_dtype("bf16") == wire.wire_dtype("torch.bfloat16") == wire.pb.BFLOAT16


@pytest.mark.parametrize("bad", ["complex128", np.float64, torch.float64, 0, 9, True, None])
def test_wire_dtype_refuses_with_the_supported_list(bad: Any) -> None:
    with pytest.raises(wire.TensorFormatError, match="uint8, float16, bfloat16, float32"):
        wire.wire_dtype(bad)
    assert issubclass(wire.TensorFormatError, ValueError)


@pytest.mark.parametrize(
    "dtype, shape, nbytes",
    [
        # numpy's int64 product wraps to 0 here: an empty payload would pass.
        (wire.pb.FLOAT32, [1, 16, 1, 2**32, 2**32], 0),
        # ... and to 4096 here (8 * (8 + 2**60) * 16 mod 2**64).
        (wire.pb.UINT8, [1, 16, 1, 8, 8 + 2**60], 4096),
        (wire.pb.FLOAT32, [2, 2], 15),
        (wire.pb.FLOAT32, [1, -16, 1, 1, 1], 0),
        (wire.pb.DATA_TYPE_UNSPECIFIED, [2], 2),
    ],
)
def test_validate_refuses_and_names_the_shape(dtype: int, shape: list[int], nbytes: int) -> None:
    message = wire.pb.Tensor(dtype=dtype, shape=shape, data=b"\0" * nbytes)
    with pytest.raises(wire.TensorFormatError) as info:
        wire.validate(message)
    assert str(shape) in str(info.value)


def test_round_trips() -> None:
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    m = wire.to_message(a)
    assert wire.validate(m) == (2, 3, 4)
    assert np.array_equal(wire.to_numpy(m), a)
    assert torch.equal(wire.to_torch(m), torch.from_numpy(a))
    empty = wire.to_message(np.zeros((0, 3), np.uint8))
    assert wire.to_numpy(empty).shape == (0, 3) and wire.to_torch(empty).shape == (0, 3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.uint8])
@pytest.mark.parametrize("view", ["head", "tail", "permuted", "strided", "contiguous"])
def test_torch_views_are_sent_as_their_c_order_bytes(dtype: torch.dtype, view: str) -> None:
    """A non-contiguous tensor (the client sends latents[:, :, :2] and the rest as slices) goes out
    as the bytes of its contiguous copy, without making that copy in torch first."""
    x = (torch.randn(1, 4, 5, 3, 6, generator=torch.Generator().manual_seed(0)) * 50).to(dtype)
    t = {"head": x[:, :, :2], "tail": x[:, :, 2:], "permuted": x.permute(0, 2, 1, 3, 4),
         "strided": x[..., ::2], "contiguous": x}[view]
    m = wire.to_message(t)
    bits = t.contiguous().view(torch.int16) if dtype == torch.bfloat16 else t.contiguous()
    assert m.data == bits.numpy().tobytes()
    assert list(m.shape) == list(t.shape)
    assert torch.equal(wire.to_torch(m), t)


@pytest.mark.parametrize("make, why", [
    (lambda x: x.to_sparse(), "sparse_coo tensor cannot travel; pass a dense one"),
    (lambda x: x.to_sparse_csr(), "sparse_csr tensor cannot travel; pass a dense one"),
    (lambda x: torch.empty_like(x, device="meta"), "a meta tensor has no data to send"),
])
def test_tensors_without_dense_data_are_refused_by_name(make: Any, why: str) -> None:
    with pytest.raises(wire.TensorFormatError, match=why):
        wire.to_message(make(torch.ones(4, 6)))


def test_big_endian_numpy_arrays_travel_as_little_endian() -> None:
    a = np.arange(24, dtype=">f4").reshape(2, 3, 4)
    m = wire.to_message(a)
    assert m.data == a.astype("<f4").tobytes()
    assert np.array_equal(wire.to_numpy(m), a)


class _CountingTensor:
    """A wire Tensor that counts reads of its payload (each read of a protobuf bytes field is a
    copy of it under the upb runtime)."""

    def __init__(self, message: Any) -> None:
        self._message = message
        self.reads = 0
        self.dtype, self.shape = message.dtype, message.shape

    @property
    def data(self) -> bytes:
        self.reads += 1
        return self._message.data


@pytest.mark.parametrize("convert", ["to_torch", "to_numpy", "storage_view"])
def test_a_payload_is_read_once_per_conversion(convert: str) -> None:
    from vaed_client import tensors

    x = torch.arange(2 * 3 * 5, dtype=torch.float32).reshape(2, 3, 5)
    counted = _CountingTensor(wire.to_message(x))
    out = getattr(tensors, convert)(counted)
    assert counted.reads == 1
    assert np.array_equal(np.asarray(out), x.numpy())


def test_the_servers_frames_read_their_payload_once() -> None:
    """The call core checks a message's header, then takes its tensor: one read for both."""
    from vaed.service import ProtoLatents

    x = torch.rand(1, 3, 5, 8, 8)
    counted = _CountingTensor(wire.to_message(x))
    frames = ProtoLatents(counted, "frames")
    assert frames.header() == ((1, 3, 5, 8, 8), torch.float32)
    assert torch.equal(frames.to_tensor(), x) and counted.reads == 1


def test_bf16_messages_round_as_torch_does() -> None:
    """float32 -> BFLOAT16 on the wire (numpy has no bf16: bit arithmetic) gives torch's own
    `.to(torch.bfloat16)` bits for every finite value and Inf, ties to even, overflow to Inf and
    subnormals included, and keeps NaN a NaN; torch tensors take torch's cast."""
    rng = np.random.default_rng(0)
    patterns = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, np.inf, -np.inf, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 1e-45, -1e-40,
                      3.3961775e38, 3.4028235e38, -3.4028235e38, np.nan, -np.nan], dtype=np.float32)
    negative_nan = np.array([0xFFFFFFFF, 0xFFFF8000, 0x7FFFFFFF], dtype=np.uint32).view(np.float32)
    x = np.concatenate([patterns, edges, negative_nan]).reshape(1, -1)
    ours = wire.to_torch(wire.to_bf16_message(x))
    theirs = torch.from_numpy(x).to(torch.bfloat16)
    assert ours.dtype == torch.bfloat16 and ours.shape == theirs.shape
    finite_or_inf = ~torch.from_numpy(np.isnan(x))
    assert torch.equal(ours[finite_or_inf].view(torch.int16), theirs[finite_or_inf].view(torch.int16))
    assert torch.isnan(ours[~finite_or_inf]).all() and int((~finite_or_inf).sum()) > 3
    from_torch = wire.to_torch(wire.to_bf16_message(torch.from_numpy(x)))
    assert torch.equal(from_torch.view(torch.int16), theirs.view(torch.int16))


@pytest.mark.parametrize("array", [
    np.arange(24, dtype=np.uint8).reshape(1, 2, 3, 4), np.zeros((1, 0, 2, 2, 3), np.uint8),
    torch.randn(1, 3, 2, 4, 4).to(torch.bfloat16), torch.randn(2, 3)[:, ::2],
])
def test_a_tensor_filled_in_place_serializes_as_one_nested(array: Any) -> None:
    """`to_message(x, out=chunk.frames)` gives the bytes of `FrameChunk(frames=to_message(x))`,
    the field present even for an empty tensor, and overwrites what `out` held."""
    nested = wire.pb.FrameChunk(chunk_index=3, frames=wire.to_message(array))
    chunk = wire.pb.FrameChunk(chunk_index=3)
    chunk.frames.shape.extend([9, 9])
    chunk.frames.data = b"old"
    assert wire.to_message(array, out=chunk.frames) is chunk.frames
    assert chunk.HasField("frames") and chunk.SerializeToString() == nested.SerializeToString()
    if not is_bf16(array):
        bits = wire.pb.FrameChunk()
        wire.to_bf16_message(np.asarray(array, np.float32), out=bits.frames)
        assert bits.frames.SerializeToString() == wire.to_bf16_message(np.asarray(array, np.float32)).SerializeToString()


def is_bf16(array: Any) -> bool:
    return isinstance(array, torch.Tensor) and array.dtype == torch.bfloat16
