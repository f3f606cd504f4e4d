"""benchmarks/upsampler_layout.py on the CPU: it finds each upsample3d image conv and the
shapes it is called with, and its re-laying keeps the values while changing the layout, and
only inside its block. Timing and the cuDNN frontend's plans are the GPU's."""

from __future__ import annotations

import torch
from harness import load_script

from vaed.choices import Kernels, Layout
from vaed.models import build_random_vae
from vaed.patches import prepare_decoder, to_decoder_layout

U = load_script("benchmarks/upsampler_layout.py")


def test_the_upsample3d_convs_are_found_and_relaid_in_their_block_only() -> None:
    vae = build_random_vae("wan2.2-tiny").eval().requires_grad_(False)
    prepare_decoder(vae, kernels=Kernels.OFF, layout=Layout.CHANNELS_LAST)
    convs = U.upsample3d_convs(vae)
    modes = [m.mode for m in vae.decoder.modules() if type(m).__name__ == "WanResample"]
    assert len(convs) == modes.count("upsample3d") > 0
    z = to_decoder_layout(torch.randn(1, vae.config.z_dim, U.LATENT_FRAMES, 4, 4), Layout.CHANNELS_LAST)
    inputs = U.conv_inputs(vae, z, convs)
    assert {id(c) for c, _, _ in inputs} == {id(c) for c in convs}
    assert len({(id(c), shape) for c, shape, _ in inputs}) == len(inputs)  # once per shape
    x = torch.randn(2, convs[0].in_channels, 8, 8)
    want = convs[0](x)
    with U.relaid_nhwc(convs):
        got = convs[0](x)
    assert torch.equal(got, want) and got.is_contiguous(memory_format=torch.channels_last)
    assert not want.is_contiguous(memory_format=torch.channels_last)
    assert convs[0](x).stride() == want.stride()  # the hooks are gone
    same, diff = U.relaid_is_stock(vae, z, convs)
    assert isinstance(same, bool) and diff >= 0
