"""prepare_decoder / remove_fast_paths / to_decoder_layout: API, fallbacks, whole decodes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vaed.patches import (
    LOSSLESS_OPS,
    REFERENCE_OPS,
    FastPathError,
    FastPathReport,
    prepare_decoder,
    remove_fast_paths,
    to_decoder_layout,
    using,
)
from vaed.models import build_random_vae

from backends import Backend, kernel_cases
from harness import assert_same_cache, chunked_decode

CUDA = torch.cuda.is_available()
cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]


def _vae(arch: str, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Any:
    return build_random_vae(arch).to(device=device, dtype=dtype).eval().requires_grad_(False)


def test_report_and_layout_on_cpu() -> None:
    vae = _vae("wan2.1-tiny")
    keys = list(vae.state_dict().keys())
    names = [n for n, _ in vae.named_parameters()]
    rep = prepare_decoder(vae)
    assert isinstance(rep, FastPathReport)
    assert rep.kernels == "off" and rep.layout == "contiguous"
    # On CPU the kernels are skipped: for the device, or earlier when triton is absent.
    assert rep.skipped and ("cpu" in rep.skipped[0] or "triton is not importable" in rep.skipped[0])
    rep = prepare_decoder(vae, kernels="off", layout="channels_last")
    assert rep.layout == "channels_last"
    w = vae.decoder.conv_in.weight
    assert w.is_contiguous(memory_format=torch.channels_last_3d)
    assert list(vae.state_dict().keys()) == keys and [n for n, _ in vae.named_parameters()] == names
    assert prepare_decoder(vae, kernels="off", layout="channels_last") == rep  # idempotent
    remove_fast_paths(vae)
    assert not any("forward" in m.__dict__ for m in vae.modules())
    with pytest.raises(ValueError):
        prepare_decoder(vae, kernels="fast")
    with pytest.raises(ValueError):
        prepare_decoder(vae, layout="nhwc")


def test_explicit_triton_on_cpu_raises() -> None:
    vae = _vae("wan2.1-tiny")
    with pytest.raises(FastPathError):
        prepare_decoder(vae, kernels="triton")


def test_to_decoder_layout() -> None:
    x = torch.randn(1, 4, 2, 3, 5)
    assert to_decoder_layout(x, "channels_last").is_contiguous(memory_format=torch.channels_last_3d)
    assert to_decoder_layout(x.contiguous(memory_format=torch.channels_last_3d), "contiguous").is_contiguous()
    assert to_decoder_layout(x, "auto").is_contiguous()  # CPU: contiguous
    with pytest.raises(ValueError):
        to_decoder_layout(x[0], "contiguous")


@pytest.mark.parametrize("arch", ["wan2.1-tiny", "wan2.2-tiny"])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_cpu_fallback_bit_identical_to_stock(arch: str, layout: str) -> None:
    """The installed forwards' per-call fallbacks (REFERENCE_OPS, and LOSSLESS_OPS whose kernels decline
    on a CPU) run on the CPU and equal stock diffusers' decode, which runs with nothing installed."""
    vae = _vae(arch)
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4)
    with torch.no_grad():
        rep = prepare_decoder(vae, kernels="off", layout=layout)
        assert rep.ops == "stock" and not any("forward" in m.__dict__ for m in vae.modules())
        want = vae.decode(to_decoder_layout(z, layout), return_dict=False)[0]
        rep = prepare_decoder(vae, kernels="off", layout=layout, ops=REFERENCE_OPS)
        assert rep.ops == "reference"
        assert any("forward" in m.__dict__ for m in vae.decoder.modules())
        outs = [chunked_decode(vae, to_decoder_layout(z, layout))[0]]
        with using(LOSSLESS_OPS):
            outs.append(chunked_decode(vae, to_decoder_layout(z, layout))[0])
    from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

    for out in outs:
        if vae.config.patch_size is not None:
            out = unpatchify(out, vae.config.patch_size)
        assert torch.equal(out.clamp(-1, 1), want)


@kernel_cases("arch", interpreter=[("wan2.1-tiny",), ("wan2.2-tiny",)])
def test_installed_paths_under_interpreter(backend: Backend, arch: str) -> None:
    """The installed lossless forwards on the Triton interpreter (tests/backends.py): within its
    exp error of stock with the norm prologue, exactly stock without it (no exp in a kernel).
    The GPU's bit-exact bar is test_cuda_decode_bit_identical."""
    torch.manual_seed(0)
    vae = build_random_vae(arch).eval().requires_grad_(False)
    z = to_decoder_layout(torch.randn(1, vae.config.z_dim, 2, 2, 3), "channels_last")
    with torch.no_grad():
        prepare_decoder(vae, kernels="off", layout="channels_last")
        want = vae.decode(z, return_dict=False)[0]
        rep = prepare_decoder(vae, kernels="triton", layout="channels_last")
        assert rep.kernels == "triton" and rep.ops == "lossless" and rep.disabled_ops == (), rep
        assert rep.op_sets["lossless"] == LOSSLESS_OPS, rep
        got = vae.decode(z, return_dict=False)[0]
        rep = prepare_decoder(vae, kernels="triton", layout="channels_last", disabled_ops={"norm_causal_pad"})
        assert rep.disabled_ops == ("norm_causal_pad",), rep
        assert rep.op_sets["lossless"].norm_causal_pad is REFERENCE_OPS.norm_causal_pad
        got_no_norm = vae.decode(z, return_dict=False)[0]
    assert got.stride() == want.stride()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)  # interpreter exp is numpy's
    # without the norm prologue (no exp in a kernel) the interpreter is exact
    assert got_no_norm.stride() == want.stride() and torch.equal(got_no_norm, want)


# --- GPU: bit-identical to stock diffusers with the same layout ---------------------------


@pytest.mark.parametrize("arch,size", [("wan2.1-tiny", (3, 6, 8)), ("wan2.2-tiny", (3, 4, 6)), ("wan2.1", (3, 12, 16))])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_decode_bit_identical(arch: str, size: tuple, dtype: torch.dtype, layout: str) -> None:
    vae = _vae(arch, "cuda", dtype)
    torch.manual_seed(1)
    z = to_decoder_layout(torch.randn(1, vae.config.z_dim, *size, device="cuda", dtype=dtype), layout)
    with torch.inference_mode():
        prepare_decoder(vae, kernels="off", layout=layout)
        want = vae.decode(z, return_dict=False)[0]
        want_raw, want_cache = chunked_decode(vae, z)
        rep = prepare_decoder(vae, kernels="triton", layout=layout)
        assert rep.kernels == "triton"
        got = vae.decode(z, return_dict=False)[0]
        got_raw, got_cache = chunked_decode(vae, z)
    assert torch.equal(got, want)
    assert got_raw.stride() == want_raw.stride() and torch.equal(got_raw, want_raw)
    assert_same_cache(got_cache, want_cache)


@pytest.mark.parametrize("arch", ["wan2.1-tiny", "wan2.2-tiny"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_lossless_defers_biases_exactly_and_checks_it_at_start_up(arch: str, monkeypatch: Any) -> None:
    """The lossless tier leaves conv2's bias to the exact residual kernel (every residual block,
    every chunk) and the time_conv's to the upsample gather, for stock's bytes; when the start-up
    check of a conv's separate bias pass fails, the tier keeps every bias in its conv (still
    stock's bytes), and ``kernels="triton"`` refuses."""
    import vaed.kernels as K
    from vaed.patches import installer
    from vaed.patches.ops import EXACT_BIAS_SITES
    from vaed.patches.checks import check_bias_deferral

    calls: dict[str, int] = {"residual": 0, "upsample": 0}
    real_residual, real_upsample = K.bias_residual_add, K.upsample_nearest2x

    def residual(x: torch.Tensor, h: torch.Tensor, bias: Any = None, *, exact: bool = False) -> Any:
        calls["residual"] += bias is not None and exact
        return real_residual(x, h, bias, exact=exact)

    def upsample(x: torch.Tensor, interleave: bool = False, bias: Any = None, **kw: Any) -> Any:
        calls["upsample"] += bias is not None
        return real_upsample(x, interleave, bias, **kw)

    vae = _vae(arch, "cuda", torch.bfloat16)
    torch.manual_seed(2)
    z = to_decoder_layout(torch.randn(1, vae.config.z_dim, 3, 4, 6, device="cuda", dtype=torch.bfloat16), "channels_last")
    blocks = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanResidualBlock")
    time_convs = sum(1 for m in vae.decoder.modules() if getattr(m, "mode", None) == "upsample3d")
    assert check_bias_deferral(torch.device("cuda"), torch.bfloat16) is None
    with torch.inference_mode():
        prepare_decoder(vae, kernels="off", layout="channels_last")
        want, _ = chunked_decode(vae, z)
        rep = prepare_decoder(vae, kernels="triton", layout="channels_last")
        assert rep.op_sets["lossless"].defer_bias == EXACT_BIAS_SITES, rep
        monkeypatch.setattr(K, "bias_residual_add", residual)
        monkeypatch.setattr(K, "upsample_nearest2x", upsample)
        got, _ = chunked_decode(vae, z)
        assert calls == {"residual": blocks * 3, "upsample": time_convs * 2}, calls  # time_conv: chunks 2, 3
        assert got.stride() == want.stride() and torch.equal(got, want)
        monkeypatch.setattr(installer, "check_bias_deferral", lambda device, dtype: "a conv adds its bias in its sum")
        rep = prepare_decoder(vae, kernels="auto", layout="channels_last")
        assert rep.op_sets["lossless"].defer_bias == frozenset(), rep
        assert any("deferred conv biases: start-up check failed" in s for s in rep.skipped), rep.skipped
        calls.update(residual=0, upsample=0)
        kept, _ = chunked_decode(vae, z)
        assert calls == {"residual": 0, "upsample": 0}, calls
        assert torch.equal(kept, want)
        with pytest.raises(FastPathError, match="its bias in its sum"):
            prepare_decoder(vae, kernels="triton", layout="channels_last")


@pytest.mark.parametrize("arch", ["wan2.1-tiny", "wan2.2-tiny"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_fast_and_fallback_chunks_interleave(arch: str) -> None:
    """Chunk loop from None/"Rep" with fast and stock chunks alternating equals stock chunk by chunk."""
    vae = _vae(arch, "cuda", torch.bfloat16)
    z = to_decoder_layout(torch.randn(1, vae.config.z_dim, 5, 4, 6, device="cuda", dtype=torch.bfloat16), "channels_last")
    with torch.inference_mode():
        prepare_decoder(vae, kernels="off", layout="channels_last")
        x = vae.post_quant_conv(z)
        n = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
        c_ref: list = [None] * n
        c_mix: list = [None] * n
        for i in range(x.shape[2]):
            fast = i % 2 == 1 if arch.startswith("wan2.1") else i % 2 == 0
            remove_fast_paths(vae)
            want = vae.decoder(x[:, :, i : i + 1], feat_cache=c_ref, feat_idx=[0], first_chunk=(i == 0))
            if fast:
                prepare_decoder(vae, kernels="triton", layout="channels_last")
            got = vae.decoder(x[:, :, i : i + 1], feat_cache=c_mix, feat_idx=[0], first_chunk=(i == 0))
            assert got.stride() == want.stride() and torch.equal(got, want), i
            for a, b in zip(c_mix, c_ref):
                if isinstance(a, torch.Tensor):
                    assert a.stride() == b.stride() and torch.equal(a, b), i
                else:
                    assert a == b
            remove_fast_paths(vae)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_cuda_grad_mode_falls_back() -> None:
    vae = _vae("wan2.1-tiny", "cuda", torch.float32)
    z = torch.randn(1, 4, 2, 4, 4, device="cuda")
    prepare_decoder(vae, kernels="triton", layout="channels_last")
    with torch.enable_grad():
        a = vae.decode(to_decoder_layout(z, "channels_last"), return_dict=False)[0]
    remove_fast_paths(vae)
    with torch.enable_grad():
        b = vae.decode(to_decoder_layout(z, "channels_last"), return_dict=False)[0]
    assert torch.equal(a, b)
