"""Shared plumbing for the Triton ops: lazy import, device gating, aten layout oracle.

Nothing here touches Triton or the environment at import time, so
``import vaed.kernels`` works on a CPU machine without Triton.
"""

from __future__ import annotations

import concurrent.futures
import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch

# dtypes every op handles; aten computes bf16/fp16 elementwise math in fp32
# ("opmath") and rounds once per op, which the kernels reproduce.
SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@functools.lru_cache(maxsize=1)
def load_triton() -> tuple[ModuleType, ModuleType] | None:
    """(triton, triton.language), or None when Triton cannot be imported."""
    try:
        triton = importlib.import_module("triton")
        tl = importlib.import_module("triton.language")
    except Exception:  # ImportError, or a broken install raising at import
        return None
    return triton, tl


def triton_available() -> bool:
    return load_triton() is not None


def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1 at first use)."""
    loaded = load_triton()
    if loaded is None:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except Exception:
        return False
    probe = loaded[0].jit(_probe)
    return isinstance(probe, InterpretedFunction)


def _probe(x):  # pragma: no cover - only decorated, never launched
    pass


def device_ok(t: torch.Tensor) -> bool:
    """Kernels run on CUDA tensors, and on CPU tensors only under the interpreter."""
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and _interp_cached()


def shortcut_pair_ok(main: torch.Tensor, source: torch.Tensor) -> bool:
    """Whether a shortcut add's kernel (dupup_add, avgdown_add) may take ``main`` and
    ``source``: both 5-D, one supported dtype, one device the kernels run on, nothing empty, no
    autograd graph to record and no torch.compile trace (the fused ops are eager-only)."""
    if not triton_available() or main.dim() != 5 or source.dim() != 5:
        return False
    if main.dtype not in SUPPORTED_DTYPES or source.dtype != main.dtype:
        return False
    if source.device != main.device or not device_ok(main) or main.numel() == 0:
        return False
    if torch.is_grad_enabled() and (main.requires_grad or source.requires_grad):
        return False
    return not torch.compiler.is_compiling()


@functools.lru_cache(maxsize=1)
def _interp_cached() -> bool:
    return interpreter_active()


def jit_lazy(
    raw: Callable[..., Any], module_globals: dict[str, Any], helpers: tuple[Callable[..., Any], ...] = ()
) -> Callable[[], Any]:
    """Decorate ``raw`` with ``triton.jit`` on first use.

    The kernel body resolves ``tl`` from its module globals at compile time, so
    the module's ``tl`` is filled in before decorating. ``helpers`` are device
    functions the kernel calls (written undecorated, like kernels, and imported
    into its module under their own names): each is jitted too and its name in
    the kernel's module bound to the jitted form.
    """
    state: dict[str, Any] = {}

    def get() -> Any:
        if "k" not in state:
            _wait_for_ahead_compile()
            for helper in helpers:
                module_globals[helper.__name__] = _jit(helper)
            state["k"] = _jit(raw)
        return state["k"]

    _KERNELS[f"{raw.__module__}.{raw.__qualname__}"] = (raw, get)
    return get


# Kernels compiled ahead into Triton's cache while the model loads (`vaed.kernels.precompile`):
# a kernel's first fetch waits for them, so its first launch finds its variants there instead of
# compiling them on the device thread.
_ahead: concurrent.futures.Future[Any] | None = None


def compile_ahead_in_flight(future: concurrent.futures.Future[Any]) -> None:
    """Make every kernel's first fetch wait for `future` (its outcome is the caller's to report)."""
    global _ahead
    _ahead = future


def _wait_for_ahead_compile() -> None:
    if _ahead is not None:
        concurrent.futures.wait([_ahead])


# kernel name (Triton's: module.qualname) -> (its undecorated function, its lazy getter), for
# the records compiled ahead (`vaed.kernels.precompile`)
_KERNELS: dict[str, tuple[Callable[..., Any], Callable[[], Any]]] = {}


def kernel_named(name: str) -> Any:
    """The jitted kernel that Triton names `name` (`vaed.kernels.precompile`); its module must
    have been imported."""
    if name not in _KERNELS:
        raise KeyError(f"no vaed kernel is named {name}")
    return _KERNELS[name][1]()


_JITTED: dict[Callable[..., Any], Any] = {}  # raw function -> its triton.jit form (helpers are shared)


def _jit(raw: Callable[..., Any]) -> Any:
    """``triton.jit(raw)`` with ``tl``, ``triton`` and ``libdevice`` filled into raw's module."""
    if raw in _JITTED:
        return _JITTED[raw]
    loaded = load_triton()
    if loaded is None:
        raise RuntimeError("triton is not importable")
    triton, tl = loaded
    module_globals = raw.__globals__
    module_globals["tl"] = tl
    module_globals["triton"] = triton
    k = triton.jit(raw)
    # libdevice expf is CUDA's expf, which aten's kernels call (tl.exp is
    # ex2.approx). The CPU interpreter has no libdevice: there tl.math
    # maps to numpy, so CPU runs of exp-using kernels are not bit-exact.
    if type(k).__name__ == "InterpretedFunction":
        module_globals["libdevice"] = tl.math
    else:
        module_globals["libdevice"] = importlib.import_module("triton.language.extra.libdevice")
    _JITTED[raw] = k
    return k


def launch_opts(t: torch.Tensor) -> dict[str, Any]:
    """Keyword options for a launch: no mul+add contraction (aten rounds each op)."""
    if t.is_cuda:
        return {"enable_fp_fusion": False}
    return {}


# Elements per program of the channels-last tile kernels (pixels x all channels) and their
# warps: 2048 bf16 values, 16 per thread. benchmarks/sweep_channel_tiles.py over every tile-kernel
# call of a steady chunk (H200, bf16, fast tier) put 2048/4 ahead of 4096/8 and 8192/16 at
# each size: 8.02 / 8.12 / 8.63 ms at 480x832, 15.01 / 15.75 / 16.84 at 720x1280, 10.53 /
# 10.58 / 11.36 at Wan2.2 704x1280.
CHANNEL_TILE = 2048
CHANNEL_TILE_WARPS = 4


def pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def channel_tile(channels: int, pixels: int | None = None) -> tuple[int, int, int]:
    """(BLOCK pixels, BLOCK_C, num_warps) of a tile kernel whose program holds every channel
    of a run of pixels: ``CHANNEL_TILE`` elements (more when one pixel's channels need it),
    no more pixels than ``pixels`` (rounded up to a power of two) when given.

    Per-channel vectors (a gamma, a bias) must be loaded at the tile's shape
    (``tl.broadcast_to(ptr + c, (BLOCK, BLOCK_C))``): a [1, BLOCK_C] load gets a layout of its
    own, one element a thread, and converting between the two went through shared memory
    with a barrier -- it made the norm prologue with a deferred bias up to 1.7x slower."""
    block_c = pow2(channels)
    block_p = max(1, CHANNEL_TILE // block_c)
    if pixels is not None:
        block_p = max(1, min(pow2(pixels), block_p))
    return block_p, block_c, CHANNEL_TILE_WARPS


def offsets_fit_int32(tensors: tuple[torch.Tensor | None, ...], slack: int = 0) -> bool:
    """True when every element offset of every tensor (+ ``slack`` for a block's overhang)
    fits in int32, so a kernel may index in 32 bits (~2x fewer integer instructions)."""
    limit = 2**31 - 1 - slack
    for t in tensors:
        if t is None:
            continue
        last = sum((size - 1) * abs(st) for size, st in zip(t.shape, t.stride(), strict=True) if size > 0)
        if t.numel() > limit or last > limit:
            return False
    return True


# --- aten layout oracle ------------------------------------------------------
# The fused ops must return tensors with exactly the strides the aten chain
# would give, because downstream cuDNN algorithms and reduction orders depend
# on the layout. Running the aten chain on meta tensors gives those strides
# exactly, at ~20 us per new shape; results are memoised per (shape, strides).


def _meta(shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device="meta")


@functools.lru_cache(maxsize=4096)
def add_strides(
    shape: tuple[int, ...], a_stride: tuple[int, ...], b_stride: tuple[int, ...]
) -> tuple[int, ...]:
    """Strides aten's ``a + b`` gives (TensorIterator's layout rules)."""
    return tuple((_meta(shape, a_stride, torch.float32) + _meta(shape, b_stride, torch.float32)).stride())


def empty_with_strides(
    shape: tuple[int, ...], stride: tuple[int, ...], like: torch.Tensor
) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=like.dtype, device=like.device)


# memory orders (outermost -> innermost) of the 5-D layouts the kernels write
ORDER_CONTIGUOUS = (0, 1, 2, 3, 4)  # B C T H W
ORDER_CL3D = (0, 2, 3, 4, 1)  # B T H W C  (channels_last_3d)
ORDER_NTCHW = (0, 2, 1, 3, 4)  # B T C H W  (a permuted (b*t, c, h, w) conv2d output)


def dense_strides(shape: tuple[int, ...], order: tuple[int, ...]) -> tuple[int, ...]:
    stride = [0] * len(shape)
    acc = 1
    for d in reversed(order):
        stride[d] = acc
        acc *= max(shape[d], 1)
    return tuple(stride)


def matches_order(shape: tuple[int, ...], stride: tuple[int, ...], order: tuple[int, ...]) -> bool:
    """True when ``stride`` is the dense layout ``order`` (size-1 dims' strides ignored)."""
    want = dense_strides(shape, order)
    return all(shape[d] == 1 or stride[d] == want[d] for d in range(len(shape)))
