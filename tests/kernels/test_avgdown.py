"""The AvgDown3D add (``avgdown_add``: ``main + AvgDown3D(source)`` in one pass, Wan2.2's
down-block shortcut): on the GPU bit-exact against stock's chain (``avgdown_add_reference``) at
Wan2.2's shortcuts and the other power-of-two group sizes, a padded first chunk, both layouts
of either input and values of wide dynamic range (where the summation order shows); the
kernel's summation order in plain torch (``avgdown_add_ordered_reference``) equals stock on the
GPU, and on the CPU wherever the order cannot matter; the op sets call the kernel.

Both backends (tests/backends.py). CPU aten may reduce in another order than CUDA's, so under
the interpreter the kernel is held to the ordered reference; the mean and the add round fp32 to
the dtype, which the interpreter truncates for bf16, so its cases are fp16 and fp32.
"""

from __future__ import annotations

import pytest
import torch

from vaed import kernels as K
from vaed import patches as P
from vaed.kernels import avgdown as A
from vaed.patches.checks import check_op
from vaed.patches.ops import FusedOp, reference_avgdown_add

from backends import Backend, grid, kernel_cases
from harness import assert_same, count_launches, lay

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROUNDING_DTYPES = (torch.float16, torch.float32)  # what the interpreter rounds like the GPU
LAYOUTS = ("cl3d", "contiguous")
# (source channels, out channels, factor_t, factor_s): Wan2.2's four down-block shortcuts
# (G = 4 space-only, 4 and 4 time and space, 1 without downsampling), then the other group
# sizes the kernel takes (G = 2, 8)
WAN22 = ((160, 160, 1, 2), (160, 320, 2, 2), (320, 640, 2, 2), (640, 640, 1, 1), (160, 320, 1, 2), (640, 640, 2, 2))
TINY = ((4, 8, 1, 2), (4, 8, 2, 2), (8, 8, 2, 2), (4, 4, 1, 1), (3, 6, 2, 2))
# (frames, source layout, main layout) of the interpreter's few cases: a first chunk, odd
# frames (padded), a steady chunk
INTERP_CHUNKS = ((1, "cl3d", "cl3d"), (3, "contiguous", "cl3d"), (4, "cl3d", "contiguous"))


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts kernel launches."""
    return count_launches(monkeypatch, A, "_kernel")


def _wide(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator, device: str) -> torch.Tensor:
    """randn * exp(3 randn): magnitudes over ~10 decades, so rounding depends on the order of
    the sum (fp16: exp(1.5 randn), clamped short of its range, where inf - inf would be NaN)."""
    x = torch.randn(shape, generator=g, device=device)
    if dtype == torch.float16:
        return (x * torch.exp(1.5 * torch.randn(shape, generator=g, device=device))).clamp(-3e4, 3e4).to(dtype)
    return (x * torch.exp(3 * torch.randn(shape, generator=g, device=device))).to(dtype)


def _inputs(backend: Backend, dtype: torch.dtype, shortcut: tuple[int, int, int, int], frames: int,
            src_layout: str, main_layout: str, hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    src_c, out_c, ft, fs = shortcut
    g = backend.generator(src_c + 10 * frames + ft)
    h, w = hw
    src = lay(_wide((2, src_c, frames, h * fs, w * fs), dtype, g, backend.device), src_layout)
    main = lay(torch.randn(2, out_c, (frames + ft - 1) // ft, h, w, generator=g, device=backend.device).to(dtype),
               main_layout)
    return main, src


@kernel_cases(
    "dtype, shortcut, frames, src_layout, main_layout",
    cuda=grid(DTYPES, WAN22, (1, 4), LAYOUTS, LAYOUTS),
    interpreter=[(d, s, *f) for d, s, f in grid((torch.float32,), TINY, INTERP_CHUNKS[:2])
                 + grid((torch.float16,), ((8, 8, 2, 2),), INTERP_CHUNKS)],
)
def test_avgdown_add_exact(backend: Backend, launches: list[int], dtype, shortcut, frames, src_layout,
                           main_layout) -> None:
    """A first chunk's one frame (front-padded in time when factor_t = 2) and a steady chunk's
    four; odd frames (3) and odd channels (3 -> 6) under the interpreter."""
    src_c, out_c, ft, fs = shortcut
    main, src = _inputs(backend, dtype, shortcut, frames, src_layout, main_layout,
                        (5, 9) if not backend.interpreter else (2, 3))
    got = K.avgdown_add(main, src, ft, fs, out_c)
    assert got is not None and launches[0] == 1
    ordered = K.avgdown_add_ordered_reference(main, src, ft, fs, out_c)
    assert_same(got, ordered)
    if not backend.interpreter:
        stock = K.avgdown_add_reference(main, src, ft, fs, out_c)
        assert_same(got, stock)
        assert_same(ordered, stock)  # the order the kernel copies is CUDA aten's


@kernel_cases("dtype", cuda=[(d,) for d in DTYPES], interpreter=[(d,) for d in ROUNDING_DTYPES])
def test_avgdown_add_any_source_strides(backend: Backend, dtype) -> None:
    """A source with strides of no standard layout (a slice of a wider tensor in frames outermost
    order) and an ntchw main: read through their strides."""
    g = backend.generator(7)
    wide = lay(_wide((1, 6, 4, 4, 6), dtype, g, backend.device), "ntchw")
    src = wide[:, 1:5]
    main = lay(torch.randn(1, 8, 2, 2, 3, generator=g, device=backend.device).to(dtype), "ntchw")
    got = K.avgdown_add(main, src, 2, 2, 8)
    assert got is not None
    assert_same(got, K.avgdown_add_ordered_reference(main, src, 2, 2, 8))
    if not backend.interpreter:
        assert_same(got, K.avgdown_add_reference(main, src, 2, 2, 8))


@kernel_cases("dtype", cuda=[(torch.bfloat16,), (torch.float32,)], interpreter=[(torch.float32,)])
def test_avgdown_add_declines(backend: Backend, launches: list[int], dtype) -> None:
    """None (the caller runs stock's chain) where the kernel cannot be exact or the shapes do not
    fit: group sizes whose aten order was not measured (3, 16), a main of the wrong shape or
    dtype, autograd."""
    dev = backend.device
    src = torch.randn(1, 3, 2, 4, 6, device=dev, dtype=dtype)
    assert K.avgdown_add(torch.zeros(1, 4, 2, 2, 3, device=dev, dtype=dtype), src, 1, 2, 4) is None  # G = 3
    src16 = torch.randn(1, 8, 2, 4, 6, device=dev, dtype=dtype)
    assert K.avgdown_add(torch.zeros(1, 4, 1, 2, 3, device=dev, dtype=dtype), src16, 2, 2, 4) is None  # G = 16
    assert K.avgdown_add(torch.zeros(1, 8, 2, 2, 3, device=dev, dtype=dtype), src16, 2, 2, 8) is None  # T' = 1
    main = torch.zeros(1, 8, 1, 2, 3, device=dev, dtype=dtype)
    assert K.avgdown_add(main.to(torch.float16), src16, 2, 2, 8) is None  # dtypes differ
    assert K.avgdown_add(main, src16, 2, 2, 16) is None  # out_channels != main's
    with torch.enable_grad():
        assert K.avgdown_add(main, src16.detach().requires_grad_(), 2, 2, 8) is None
    assert launches[0] == 0
    assert K.avgdown_add(main, src16, 2, 2, 8) is not None and launches[0] == 1  # each differs from this in one way
    with pytest.raises(ValueError, match="factors"):
        K.avgdown_add(src, src, 0, 2, 4)


@kernel_cases("dtype", cuda=[(d,) for d in DTYPES], interpreter=[(torch.float32,)])
def test_lossless_avgdown_add_passes_its_start_up_check(backend: Backend, launches: list[int], dtype) -> None:
    """The start-up cases (group sizes 1, 2, 4, 8; a padded first chunk) run through the kernel
    itself and match (torch.equal on the GPU)."""
    assert check_op(P.LOSSLESS_OPS, "avgdown_add", torch.device(backend.device), dtype) is None
    assert launches[0] == 12


# --- CPU, no kernel --------------------------------------------------------------------


@pytest.mark.parametrize("shortcut", TINY, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_ordered_reference_is_stock_where_the_order_cannot_matter(shortcut, dtype) -> None:
    """Integer-valued inputs (every partial sum exact) at every group size, and any values at
    G <= 2 (one addition): the ordered reference gives stock's bits on the CPU too, so it can
    fail where its indexing, padding or rounding is wrong."""
    src_c, out_c, ft, fs = shortcut
    g = torch.Generator().manual_seed(src_c + ft)
    for frames in (1, 4):
        t = (frames + ft - 1) // ft
        ints = torch.randint(-8, 9, (1, src_c, frames, 2 * fs, 3 * fs), generator=g).to(dtype)
        main = torch.randint(-8, 9, (1, out_c, t, 2, 3), generator=g).to(dtype)
        assert_same(K.avgdown_add_ordered_reference(main, ints, ft, fs, out_c),
                    K.avgdown_add_reference(main, ints, ft, fs, out_c))
        if src_c * ft * fs * fs // out_c <= 2:
            src = lay(torch.randn(1, src_c, frames, 2 * fs, 3 * fs, generator=g).to(dtype), "cl3d")
            assert_same(K.avgdown_add_ordered_reference(main, src, ft, fs, out_c),
                        K.avgdown_add_reference(main, src, ft, fs, out_c))


def test_the_op_sets_fuse_avgdown_add() -> None:
    """Lossless and fast name the kernel (its reference is stock's chain); --disable-op still
    switches it back; on a CPU without the interpreter it declines and the op runs stock."""
    for ops in (P.LOSSLESS_OPS, P.LOSSLESS_TILED_OPS, P.FAST_OPS):
        assert "avgdown_add" in ops.differs_from_reference(), ops.name
        op = ops.avgdown_add
        assert isinstance(op, FusedOp) and op.kernel is K.avgdown_add and op.reference is reference_avgdown_add
        assert ops.without({"avgdown_add"}).avgdown_add is P.REFERENCE_OPS.avgdown_add
    assert reference_avgdown_add is K.avgdown_add_reference
    main = torch.randn(1, 8, 1, 2, 3)
    src = torch.randn(1, 8, 1, 4, 6)
    assert K.avgdown_add(main, src, 2, 2, 8) is None  # CPU: the kernel runs under the interpreter only
    assert_same(P.LOSSLESS_OPS.avgdown_add(main, src, 2, 2, 8), K.avgdown_add_reference(main, src, 2, 2, 8))
