"""benchmarks/first_chunk_taps.py on the CPU: it finds every causal conv of a real first chunk
(and no other conv), counts differing bit patterns (one ulp and -0 included), and reports a
form as exact only with no mismatch. Timing is the GPU's, replaced by zeros here."""

from __future__ import annotations

import pytest
import torch

from vaed.choices import Kernels, Layout
from vaed.models import build_random_vae
from vaed.patches import prepare_decoder, to_decoder_layout

from harness import load_script

T = load_script("benchmarks/first_chunk_taps.py")


def test_bit_mismatches_counts_an_ulp_and_a_signed_zero() -> None:
    a = torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16)
    b = a.clone()
    assert T.bit_mismatches(a, b) == 0
    b.view(torch.int16)[0] += 1  # one bf16 ulp up
    b[1] = -0.0
    assert T.bit_mismatches(a, b) == 2
    with pytest.raises(ValueError, match="shapes differ"):
        T.bit_mismatches(a, a[:2])


def test_a_first_chunk_conv_is_told_from_a_steady_one() -> None:
    w = torch.zeros(4, 6, 3, 3, 3)
    x = torch.zeros(1, 6, 3, 5, 7)
    x[:, :, 2] = 1.0
    assert T.is_first_chunk_causal(x, w)
    x[:, :, 0, 1, 1] = 1.0  # a cached frame in front: a steady chunk
    assert not T.is_first_chunk_causal(x, w)
    assert not T.is_first_chunk_causal(torch.zeros(1, 6, 4, 5, 7), w)
    assert not T.is_first_chunk_causal(torch.zeros(1, 6, 1, 5, 7), torch.zeros(4, 6, 1, 3, 3))


def test_a_tiny_first_chunk_is_probed_conv_by_conv(monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture) -> None:
    monkeypatch.setattr(T, "gpu_ms", lambda fn, iters=1: 1.0)
    vae = build_random_vae("wan2.1-tiny").to(torch.bfloat16).eval().requires_grad_(False)
    prepare_decoder(vae, kernels=Kernels.OFF, layout=Layout.CHANNELS_LAST)
    z = to_decoder_layout(torch.randn(1, vae.config.z_dim, 2, 4, 4, dtype=torch.bfloat16), Layout.CHANNELS_LAST)
    rows = T.collect(vae, z, None, 1)
    causal = sum(1 for name, m in vae.decoder.named_modules()
                 if type(m).__name__ == "WanCausalConv3d" and m.kernel_size[0] == 3 and not name.endswith("time_conv"))
    # frame 0's 3-tap causal convs once each (no time_conv runs on it; 1x1x1 shortcuts have no
    # time taps), none of latent frame 1's
    assert len(rows) == causal
    for r in rows:
        assert [c.name for c in r.candidates] == ["conv2d", "conv3d-1tap"]
        assert all(c.error is None and c.mismatches is not None for c in r.candidates)
        best = r.fastest_exact()
        assert best is None or best.mismatches == 0
    T.report(rows)
    out = capsys.readouterr().out
    assert f"first chunk: {causal} causal convs, stock {causal:.3f} ms" in out
