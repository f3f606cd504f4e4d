"""Sharded decode on two GPUs (NCCL) against the one-GPU lossless engine. Runs on an H200 pair:

    NCCL_NVLS_ENABLE=0 python -m pytest -q tests/parallel/test_sharded_cuda.py
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from vaed.parallel import GroupConfig, ShardedEngine, start_sharded_engine
from vaed.engine import OutputSpec

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

RAW = OutputSpec(rgb8=False, raw_dtype=None, raw_latents=False)
RGB8 = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def gpu_group(request: pytest.FixtureRequest) -> Iterator[ShardedEngine]:
    engine = start_sharded_engine(GroupConfig("random:wan2.1", ("cuda:0", "cuda:1"), dtype=request.param))
    try:
        yield engine
    finally:
        engine.close()


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = (a.float() - b.float()).pow(2).mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


@pytest.mark.parametrize(("axis", "h", "w"), [("width", 30, 52), ("height", 31, 20)])
def test_two_gpu_shards_match_one_gpu(gpu_group: ShardedEngine, axis: str, h: int, w: int, monkeypatch: Any) -> None:
    import vaed.kernels as K

    fused_calls = []
    real = K.causal_pad

    def counting(x: torch.Tensor, cache: Any, pad: Any, **kwargs: Any) -> Any:
        out = real(x, cache, pad, **kwargs)
        # what each call was, so a fall back names its shapes, strides and arguments
        fused_calls.append((out is not None, (tuple(x.shape), x.stride(), x.dtype,
                                              None if cache is None else (tuple(cache.shape), cache.stride()),
                                              tuple(pad), kwargs.get("zero_history"), kwargs.get("norm") is not None)))
        return out

    monkeypatch.setattr(K, "causal_pad", counting)
    z = torch.randn(1, 16, 3, h, w, generator=torch.Generator().manual_seed(0))
    gpu_group.axis = axis
    try:
        got = gpu_group.decode_video(z, RAW)
        sharded_calls = list(fused_calls)
        want = gpu_group.base.decode_video(z, RAW)
        rgb = gpu_group.decode_video(z, RGB8)
    finally:
        gpu_group.axis = "auto"
    # the fused conv-input kernel runs on the shards (rank 0 counted): no silent fall back to stock
    fell_back = [call for fused, call in sharded_calls if not fused]
    assert sharded_calls and not fell_back, fell_back[:4]
    diff = (got.float() - want.float()).abs().max().item()
    if gpu_group.dtype == torch.float32:
        assert diff <= 5e-3  # cuDNN picks other algorithms (TF32 allowed) for other sizes
    else:
        assert _psnr(rgb, gpu_group.base.decode_video(z, RGB8)) >= 40.0
    peaks = gpu_group.peak_memory()
    assert len(peaks) == 2 and all(p > 0 for p in peaks)


def test_fast_tier_runs_sharded_with_its_own_ops(gpu_group: ShardedEngine) -> None:
    if gpu_group.dtype != torch.bfloat16 or "fast" not in getattr(gpu_group.base.fast_paths, "op_sets", {}):
        pytest.skip("the fast tier is prepared for bf16 only")
    fast = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=False, precision="fast")
    z = torch.randn(1, 16, 3, 30, 52, generator=torch.Generator().manual_seed(1))
    sharded = gpu_group.decode_video(z, fast)
    one_gpu = gpu_group.base.decode_video(z, fast)
    assert sharded.shape == one_gpu.shape
    assert _psnr(sharded, one_gpu) >= 40.0
