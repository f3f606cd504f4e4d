"""The shard forward and its plain-torch inner ops, in one process (a gloo group of one).

With one rank the halo rows are the outer edges' zero rows, so the sharded
forward must reproduce the one-GPU decode; `AtenOps` must equal diffusers'
own modules op for op (torch.equal).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from diffusers.models.autoencoders import autoencoder_kl_wan as W

from vaed.engine import DecodeEngine
from vaed.parallel.forward import ShardContext, check_shardable, decoder_forward
from vaed.parallel.inner_ops import ATEN_OPS, resolve_inner_ops
from vaed.parallel.plan import ShardPlan
from vaed.patches.fast import FAST_OPS
from vaed.engine import OutputSpec


@pytest.fixture(scope="module")
def solo_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module", params=["random:wan2.1-tiny", "random:wan2.2-tiny"])
def engine(request: pytest.FixtureRequest) -> DecodeEngine:
    return DecodeEngine.load(request.param, device="cpu", dtype="float32")


@pytest.mark.parametrize(("axis", "kernels"), [("height", "off"), ("width", "auto"), ("height", "fast")])
def test_shard_forward_on_one_rank_equals_the_one_gpu_decode(
    solo_group: None, engine: DecodeEngine, axis: str, kernels: str
) -> None:
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    check_shardable(engine.vae.decoder)
    z = torch.randn(1, engine.z_dim, 3, 3, 5, generator=torch.Generator().manual_seed(0))
    want = engine.decode_video(z, OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True))
    plan = ShardPlan(axis, (3,) if axis == "height" else (5,))  # type: ignore[arg-type]
    # "fast": the fast tier's op set, as a sharded fast session runs it (its kernels decline on
    # the CPU, so its reference chains run; it must take the norms the sharded forwards build)
    ctx = ShardContext(None, 0, plan, FAST_OPS if kernels == "fast" else resolve_inner_ops(kernels))
    cache: list = [None] * engine.num_convs
    outs = []
    with torch.inference_mode():
        for i in range(z.shape[2]):
            x = engine.vae.post_quant_conv(z[:, :, i : i + 1])
            out = decoder_forward(ctx, engine.vae.decoder, x, cache, first_chunk=i == 0)
            if engine.patch_size is not None:
                out = unpatchify(out, patch_size=engine.patch_size)
            outs.append(out.clamp(-1, 1))
    got = torch.cat(outs, dim=2)
    assert got.shape == want.shape
    # same math; the conv sees a pre-padded input instead of padding itself, so allow rounding
    assert (got - want).abs().max().item() <= 2e-5
    # the cache list has diffusers' layout: the same slots used, the same "Rep" marker slots
    state = engine.new_state()
    for i in range(z.shape[2]):
        engine.decode_frame(state, z[:, :, i : i + 1], OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True))
    assert state.cache is not None
    assert [type(c) for c in cache] == [type(c) for c in state.cache]


def test_aten_ops_equal_diffusers_modules() -> None:
    torch.manual_seed(0)
    conv = W.WanCausalConv3d(4, 6, 3, padding=1).eval()
    norm = W.WanRMS_norm(4, images=False)
    with torch.no_grad():
        norm.gamma.uniform_(0.5, 1.5)
    x = torch.randn(1, 4, 2, 5, 7)
    prev = torch.randn(1, 4, 2, 5, 7)
    with torch.inference_mode():
        # conv input + next cache, with the norm fused in, against the residual block's stock lines
        act = torch.nn.functional.silu(norm(x))
        stock_cache = act[:, :, -2:].clone()
        stock = conv(act, prev)
        padded, nxt = ATEN_OPS.causal_conv_input(x, prev, tuple(conv._padding), norm=norm)
        assert torch.equal(ATEN_OPS.conv3d(conv, padded), stock)
        assert torch.equal(nxt, stock_cache)
        # one new frame: the next cache keeps the previous cache's last frame in front
        one = x[:, :, :1]
        _, nxt1 = ATEN_OPS.causal_conv_input(one, prev, tuple(conv._padding))
        assert torch.equal(nxt1, torch.cat([prev[:, :, -1:], one], dim=2))
        # "Rep": no history, zeros in front of the next cache
        p_rep, n_rep = ATEN_OPS.causal_conv_input(one, None, (0, 0, 0, 0, 2, 0), zero_history=True)
        assert torch.equal(p_rep[:, :, :2], torch.zeros_like(p_rep[:, :, :2]))
        assert torch.equal(n_rep, torch.cat([torch.zeros_like(one), one], dim=2))
        # the upsample of WanResample (upsample2d) and the DupUp3D shortcut
        rs = W.WanResample(4, "upsample2d", upsample_out_dim=4).eval()
        images = ATEN_OPS.upsample2x(x, False)
        assert torch.equal(rs.resample[1](images).view(1, 2, 4, 10, 14).permute(0, 2, 1, 3, 4), rs(x))
        dup = W.DupUp3D(4, 2, factor_t=2, factor_s=2)
        main = torch.randn(1, 2, 3, 10, 14)
        assert torch.equal(ATEN_OPS.dupup_add(main, x, 2, 2, True), main + dup(x, first_chunk=True))


def test_unsupported_decoders_are_refused() -> None:
    with pytest.raises(TypeError, match="WanDecoder3d"):
        check_shardable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="kernels must be"):
        resolve_inner_ops("fast")


def test_the_version_guard_covers_the_sharded_forwards(engine: DecodeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shards walk the same ported forwards as one GPU: outside the verified diffusers range
    sharding is refused, as the installer serves the stock decoder there."""
    import diffusers

    monkeypatch.setattr(diffusers, "__version__", "0.43.0")
    with pytest.raises(ValueError, match="diffusers 0.43.0 is outside"):
        check_shardable(engine.vae.decoder)
    monkeypatch.setattr(diffusers, "__version__", "0.42.1")
    check_shardable(engine.vae.decoder)
