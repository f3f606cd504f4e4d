"""The DupUp3D add (``dupup_add``: ``main + DupUp3D(source)`` in one pass, Wan2.2's up-block
shortcut): bit-exact against ``dupup_add_reference`` for every layout of ``main`` (the flat
kernel) and for a channels_last_3d ``main`` (the 2-D tile kernel, launches counted), with and
without the upsampler conv's deferred bias, from sources in every layout.

Both backends (tests/backends.py). The add rounds fp32 to the output dtype, which the
interpreter truncates for bf16, so its cases are fp16 and fp32; the GPU covers bf16 too.
"""

from __future__ import annotations

import pytest
import torch

from vaed import kernels as K
from vaed.kernels import dupup as D
from vaed.kernels.dupup import dupup_reference

from backends import Backend, grid, kernel_cases
from harness import assert_same, count_launches, lay

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUNDING_DTYPES = (torch.float16, torch.float32)  # what the interpreter rounds like the GPU
FT_FIRST = ((1, False), (2, False), (2, True))


@pytest.fixture
def tile_launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts launches of the 2-D tile kernel."""
    return count_launches(monkeypatch, D, "_cl_kernel")


@kernel_cases(
    "dtype, layout, ft, first, frames",
    cuda=[(d, l, *f, 3) for d, l, f in grid(DTYPES, ("cl3d", "contiguous", "ntchw"), FT_FIRST)],
    interpreter=[(d, l, *f, n) for d, l, f, n in grid(ROUNDING_DTYPES, ("cl3d", "contiguous", "ntchw"), FT_FIRST, (1, 2))],
)
def test_dupup_add_exact(backend: Backend, dtype, layout, ft, first, frames) -> None:
    """main in every layout (the flat kernel takes non-cl3d mains), sources channels_last_3d and
    NTCHW (Wan2.2's lossless activations after an upsampler), with and without the upsampler
    conv's deferred bias: added to main and rounded first in either kernel."""
    (sc, sh, sw), mc = ((16, 5, 6), 8) if not backend.interpreter else ((4, 3, 4), 2)
    g = backend.generator(frames + ft)
    src = lay(torch.randn(1, sc, frames, sh, sw, device=backend.device, dtype=dtype, generator=g), "cl3d")
    t = frames * ft - (ft - 1 if first else 0)
    main = lay(torch.randn(1, mc, t, 2 * sh, 2 * sw, device=backend.device, dtype=dtype, generator=g), layout)
    bias = torch.randn(mc, device=backend.device, dtype=dtype, generator=g)
    for source in (src, lay(src, "ntchw")):
        got = K.dupup_add(main, source, ft, 2, first)
        assert got is not None
        assert_same(got, K.dupup_add_reference(main, source, ft, 2, first))
        with_bias = K.dupup_add(main, source, ft, 2, first, bias)
        assert with_bias is not None
        assert_same(with_bias, K.dupup_add_reference(main, source, ft, 2, first, bias))
        assert not torch.equal(with_bias, got)  # the bias is not ignored


@kernel_cases(
    "dtype, main_c, src_c, ft, first, src_layout",
    cuda=[(d, *c, *f, "cl3d") for d, c, f in grid(DTYPES, ((96, 192), (256, 512), (512, 1024), (1024, 1024), (24, 6)), FT_FIRST)],
    interpreter=[(d, *c, *f, s) for d, c, f, s in grid(ROUNDING_DTYPES, ((3, 6), (8, 8), (8, 32), (6, 3), (8, 4)), FT_FIRST,
                                                       ("cl3d", "contiguous", "ntchw"))],
)
def test_dupup_add_tile_kernel_exact(backend: Backend, tile_launches: list[int], dtype, main_c, src_c, ft, first, src_layout) -> None:
    """The channels_last_3d tile kernel at repeat counts C/8 .. 4C (the GPU: Wan2.2's up-block
    widths), B = 2, with the upsampler conv's deferred bias: added to main and rounded first,
    as the conv's own bias pass rounds, so still bit-exact (the flat kernel's too: a contiguous
    main); a source in another layout is copied channels-last for the tile kernel first."""
    (sh, sw) = (5, 7) if not backend.interpreter else (3, 5)
    g = backend.generator(main_c + ft)
    src = lay(torch.randn(2, src_c, 2, sh, sw, device=backend.device, dtype=dtype, generator=g), src_layout)
    t = 2 * ft - (ft - 1 if first else 0)
    main = lay(torch.randn(2, main_c, t, 2 * sh, 2 * sw, device=backend.device, dtype=dtype, generator=g), "cl3d")
    got = K.dupup_add(main, src, ft, 2, first)
    assert got is not None
    assert_same(got, K.dupup_add_reference(main, src, ft, 2, first))
    bias = torch.randn(main_c, device=backend.device, dtype=dtype, generator=g)
    with_bias = K.dupup_add(main, src, ft, 2, first, bias)
    assert with_bias is not None
    assert_same(with_bias, K.dupup_add_reference(main, src, ft, 2, first, bias))
    assert_same(with_bias, (main + bias.view(1, -1, 1, 1, 1)) + dupup_reference(src, main_c, ft, 2, first))
    assert not torch.equal(with_bias, got)  # the bias is not ignored
    assert tile_launches[0] == 2, tile_launches  # both through the tile kernel
    flat = K.dupup_add(main.contiguous(), src, ft, 2, first, bias)
    assert flat is not None and flat.is_contiguous()
    assert tile_launches[0] == 2, tile_launches  # a contiguous main: the flat kernel
    assert_same(flat, K.dupup_add_reference(main.contiguous(), src, ft, 2, first, bias))
