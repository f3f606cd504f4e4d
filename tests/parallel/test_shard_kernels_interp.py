"""The fused kernels run on shards: the shard forward with the lossless op set, every conv-input
build taken by the kernel (none falls back to the reference chain), and the result matching the
plain-torch shard forward. On the Triton interpreter (tests/backends.py: a child pytest with
TRITON_INTERPRET=1); the GPU's sharded decode is test_sharded_cuda.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vaed import kernels as K

from backends import Backend, kernel_cases


@kernel_cases("", interpreter=[()])
def test_lossless_kernels_take_every_shard_conv_input(backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    from vaed.engine import DecodeEngine
    from vaed.parallel.forward import ShardContext, decoder_forward
    from vaed.parallel.inner_ops import ATEN_OPS, resolve_inner_ops
    from vaed.parallel.plan import ShardPlan

    calls: list[bool] = []
    real = K.causal_pad

    def counting(*a, **k):  # type: ignore[no-untyped-def]
        out = real(*a, **k)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(K, "causal_pad", counting)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        engine = DecodeEngine.load("random:wan2.2-tiny", device="cpu", dtype="float32", kernels="off")
        fused = resolve_inner_ops("auto")
        assert fused is not ATEN_OPS
        z = torch.randn(1, engine.z_dim, 2, 2, 3, generator=torch.Generator().manual_seed(0))
        outs = {}
        for name, ops in (("fused", fused), ("aten", ATEN_OPS)):
            ctx = ShardContext(None, 0, ShardPlan("width", (3,)), ops)
            cache = [None] * engine.num_convs
            with torch.inference_mode():
                outs[name] = [
                    decoder_forward(ctx, engine.vae.decoder, engine.vae.post_quant_conv(z[:, :, i : i + 1]),
                                    cache, i == 0)
                    for i in range(2)
                ]
    finally:
        dist.destroy_process_group()
    n_fused = len(calls)
    assert n_fused > 20 and all(calls), (n_fused, calls.count(False))
    diff = max((a - b).abs().max().item() for a, b in zip(outs["fused"], outs["aten"], strict=True))
    assert diff <= 1e-4, diff
