"""The patch table on the CPU: ported forwards over REFERENCE_OPS equal stock diffusers, op sets per call,
per-op switch-offs and start-up checks, and the diffusers version guard."""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Any

import pytest
import torch

from vaed import patches as P
from vaed.models import build_random_vae
from vaed.patches.checks import check_op, check_op_set
from vaed.patches.ops import (
    ALL_BIAS_SITES,
    EXACT_BIAS_SITES,
    BiasSite,
    FusedOp,
    reference_residual_add,
    reference_upsample,
)

from harness import assert_same, assert_same_cache, chunked_decode

ARCHS = ["wan2.1-tiny", "wan2.2-tiny"]


def _vae(arch: str, dtype: torch.dtype = torch.float32) -> Any:
    return build_random_vae(arch).to(dtype=dtype).eval().requires_grad_(False)


def _counting(ops: P.OpSet, name: str = "counting") -> tuple[P.OpSet, collections.Counter]:
    """``ops`` with every op wrapped to count its calls (the wrappers differ from the references)."""
    calls: collections.Counter = collections.Counter()

    def wrap(op_name: str, fn: Any) -> Any:
        def counted(*a: Any, **k: Any) -> Any:
            calls[op_name] += 1
            return fn(*a, **k)

        return counted

    fields = {n: wrap(n, getattr(ops, n)) for n in P.OP_NAMES}
    return dataclasses.replace(ops, name=name, uses_triton=False, **fields), calls


def _patched(vae: Any) -> list[str]:
    return sorted({type(m).__name__ for m in vae.modules() if "forward" in m.__dict__})


# --- the ported forwards, run on the CPU, against stock diffusers -----------------


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_forwards_bit_identical_to_stock(arch: str, layout: str, dtype: torch.dtype) -> None:
    """Every patched forward runs its op-set path (counted) and equals the unpatched decoder, caches included."""
    vae = _vae(arch, dtype)
    torch.manual_seed(0)
    z = P.to_decoder_layout(torch.randn(1, vae.config.z_dim, 4, 4, 4, dtype=dtype), layout)
    ops, calls = _counting(P.REFERENCE_OPS)
    with torch.no_grad():
        P.prepare_decoder(vae, kernels="off", layout=layout)
        assert _patched(vae) == []  # kernels off: the stock decoder
        want, want_cache = chunked_decode(vae, z)
        want_decode = vae.decode(z, return_dict=False)[0]
        rep = P.prepare_decoder(vae, layout=layout, ops=ops)
        calls.clear()  # the start-up checks called each op
        assert rep.ops == "counting" and rep.stock_reason is None and rep.op_sets == {"counting": ops}
        expect = ["WanCausalConv3d", "WanDecoder3d", "WanEncoder3d", "WanResample", "WanResidualBlock"]
        expect += ["WanResidualUpBlock", "WanResidualDownBlock"] if arch.startswith("wan2.2") else ["WanUpBlock"]
        assert _patched(vae) == sorted(expect)
        got, got_cache = chunked_decode(vae, z)
        got_decode = vae.decode(z, return_dict=False)[0]
    assert_same(got, want)
    assert_same_cache(got_cache, want_cache)
    assert_same(got_decode, want_decode)
    used = {"causal_pad", "norm_causal_pad", "upsample", "upsample_interleave", "conv3d", "conv2d", "residual_add",
            "norm_causal_conv"}  # asked first at every norm site; the reference declines, the pair above runs
    if arch.startswith("wan2.2"):
        used.add("dupup_add")
    assert {n for n, c in calls.items() if c} == used


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tier", ["lossless", "lossless-tiled", "fast"])
def test_triton_op_sets_fall_back_per_call_on_cpu(arch: str, tier: str) -> None:
    """Triton op sets on CPU tensors (no interpreter): each FusedOp's kernel declines and its reference
    runs, bit-identical to stock -- the fast tier included, as its fallbacks are the exact chains."""
    ops = {"lossless": P.LOSSLESS_OPS, "lossless-tiled": P.LOSSLESS_TILED_OPS, "fast": P.FAST_OPS}[tier]
    assert P.OP_SETS.get(tier, ops) is ops
    vae = _vae(arch)
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4)
    with torch.no_grad():
        want, want_cache = chunked_decode(vae, z)
        P.prepare_decoder(vae, layout="contiguous", ops=P.REFERENCE_OPS)
        with P.using(ops):
            got, got_cache = chunked_decode(vae, z)
    assert_same(got, want)
    assert_same_cache(got_cache, want_cache)


@pytest.mark.parametrize("arch", ARCHS)
def test_whole_call_fallbacks_run_stock(arch: str) -> None:
    """Autograd on, or no causal cache: the stock forwards run (no op is called) and results match."""
    vae = _vae(arch)
    z = torch.randn(1, vae.config.z_dim, 2, 4, 4)
    with torch.no_grad():
        x = vae.post_quant_conv(z)
        want_nocache = vae.decoder(x[:, :, :1], first_chunk=True)
    with torch.enable_grad():
        want_grad = vae.decode(z, return_dict=False)[0]
    ops, calls = _counting(P.REFERENCE_OPS)
    P.prepare_decoder(vae, layout="contiguous", ops=ops)
    calls.clear()
    with torch.enable_grad():
        got_grad = vae.decode(z, return_dict=False)[0]
    assert sum(calls.values()) == 0
    with torch.no_grad():
        got_nocache = vae.decoder(x[:, :, :1], first_chunk=True)
    # without a cache only WanCausalConv3d/WanResample/WanResidualUpBlock take the op path
    assert calls["norm_causal_pad"] == 0 and calls["causal_pad"] > 0
    assert_same(got_grad, want_grad)
    assert_same(got_nocache, want_nocache)


def test_using_is_per_call_and_per_thread() -> None:
    vae = _vae("wan2.1-tiny")
    z = torch.randn(1, 4, 2, 4, 4)
    default, d_calls = _counting(P.REFERENCE_OPS, "default")
    other, o_calls = _counting(P.REFERENCE_OPS, "other")
    P.prepare_decoder(vae, layout="contiguous", ops=default)
    d_calls.clear()
    with torch.no_grad():
        want, _ = chunked_decode(vae, z)
        n_default = sum(d_calls.values())
        assert n_default > 0 and sum(o_calls.values()) == 0
        seen: list[P.OpSet | None] = []
        with P.using(other):
            assert P.current_ops() is other
            # another thread does not see this thread's op set
            th = threading.Thread(target=lambda: seen.append(P.current_ops()))
            th.start()
            th.join()
            got, _ = chunked_decode(vae, z)
        assert P.current_ops() is None
    assert seen == [None]
    assert sum(o_calls.values()) == n_default and sum(d_calls.values()) == n_default
    assert_same(got, want)
    with pytest.raises(TypeError), P.using("lossless"):  # type: ignore[arg-type]
        pass


# --- per-op switch-offs and start-up checks -------------------------------------------


def test_without_swaps_single_ops() -> None:
    ops = P.LOSSLESS_OPS.without({"upsample", "dupup_add"})
    assert ops.upsample is P.REFERENCE_OPS.upsample and ops.dupup_add is P.REFERENCE_OPS.dupup_add
    assert ops.causal_pad is P.LOSSLESS_OPS.causal_pad and ops.upsample_interleave is P.LOSSLESS_OPS.upsample_interleave
    assert set(ops.differs_from_reference()) == {
        "causal_pad", "norm_causal_pad", "upsample_interleave", "avgdown_add", "conv3d", "conv2d", "residual_add"
    }
    assert P.LOSSLESS_OPS.without(()) is P.LOSSLESS_OPS
    with pytest.raises(ValueError, match="unknown op names"):
        P.LOSSLESS_OPS.without({"upsampel"})


def _broken(ops: P.OpSet) -> P.OpSet:
    """residual_add off by a factor: a lossy op that fails any check."""
    return dataclasses.replace(ops, name="broken", uses_triton=False, residual_add=lambda x, h: x + h * 1.5)


def test_failed_check_disables_that_op_only() -> None:
    vae = _vae("wan2.1-tiny")
    counted, _ = _counting(P.REFERENCE_OPS)
    ops = dataclasses.replace(_broken(counted))
    rep = P.prepare_decoder(vae, layout="contiguous", ops=ops)
    assert rep.disabled_ops == ("residual_add",)
    assert any("residual_add: start-up check failed" in s for s in rep.skipped)
    installed = rep.ops_for("broken")
    assert installed.residual_add is reference_residual_add
    assert installed.upsample is counted.upsample  # the others stay
    assert "disabled=residual_add" in rep.summary
    with pytest.raises(KeyError, match="usable tiers"):
        rep.ops_for("fast")
    with pytest.raises(P.FastPathError, match="start-up checks failed"):
        P.prepare_decoder(vae, layout="contiguous", ops=ops, kernels="triton")


def test_disabled_ops_flag() -> None:
    vae = _vae("wan2.2-tiny")
    counted, calls = _counting(P.REFERENCE_OPS)
    rep = P.prepare_decoder(vae, layout="contiguous", ops=counted, disabled_ops={"dupup_add", "upsample"})
    assert rep.disabled_ops == ("upsample", "dupup_add")
    assert "dupup_add: disabled by flag" in rep.skipped and "upsample: disabled by flag" in rep.skipped
    calls.clear()
    ops = rep.ops_for("counting")
    assert ops.dupup_add is P.REFERENCE_OPS.dupup_add and ops.upsample is reference_upsample
    with torch.no_grad():
        chunked_decode(vae, torch.randn(1, 6, 2, 2, 2))
    assert calls["dupup_add"] == 0 and calls["upsample"] == 0 and calls["upsample_interleave"] > 0
    with pytest.raises(ValueError, match="unknown op names"):
        P.prepare_decoder(vae, disabled_ops={"norm"})
    with pytest.raises(ValueError, match="unknown tier"):
        P.prepare_decoder(vae, tiers=("turbo",))


def test_check_op_catches_declines_and_mismatches() -> None:
    cpu, f32 = torch.device("cpu"), torch.float32
    # every reference op passes against itself, on every check case
    for name in P.OP_NAMES:
        assert check_op(P.REFERENCE_OPS, name, cpu, f32) is None, name
    declining = dataclasses.replace(
        P.REFERENCE_OPS, upsample=FusedOp("upsample", lambda x, interleave=False: None, reference_upsample)
    )
    assert "declined" in (check_op(declining, "upsample", cpu, f32) or "")
    assert "values" in (check_op(_broken(P.REFERENCE_OPS), "residual_add", cpu, f32) or "")
    strided = dataclasses.replace(P.REFERENCE_OPS, residual_add=lambda x, h: (x + h).contiguous())
    assert "strides" in (check_op(strided, "residual_add", cpu, f32) or "")
    raising = dataclasses.replace(P.REFERENCE_OPS, conv2d=lambda conv, x: 1 / 0)
    assert "ZeroDivisionError" in (check_op(raising, "conv2d", cpu, f32) or "")
    assert check_op_set(P.REFERENCE_OPS, cpu, f32) == {}  # nothing differs: nothing runs


# --- diffusers version guard --------------------------------------------------------------


@pytest.mark.parametrize("version,ok", [
    ("0.42.1", True), ("0.38.0", True), ("0.40.0.dev0", True),
    ("0.37.1", False), ("0.43.0.dev0", False), ("0.43.0", False), ("1.0.0", False), ("garbage", False),
])  # fmt: skip
def test_version_guard_range(version: str, ok: bool) -> None:
    reason = P.diffusers_unverified_reason(version)
    assert (reason is None) == ok, reason
    if not ok:
        assert version in reason and "0.38.x-0.42.x" in reason


def test_version_guard_serves_stock(monkeypatch: pytest.MonkeyPatch) -> None:
    import diffusers

    vae = _vae("wan2.1-tiny")
    z = torch.randn(1, 4, 2, 4, 4)
    with torch.no_grad():
        want, _ = chunked_decode(vae, z)
    monkeypatch.setattr(diffusers, "__version__", "0.37.1")
    rep = P.prepare_decoder(vae, layout="contiguous", ops=P.REFERENCE_OPS)
    assert rep.stock_reason is not None and "diffusers 0.37.1" in rep.stock_reason
    assert rep.stock_reason in rep.summary and rep.summary.startswith("stock decoder")
    assert rep.op_sets == {} and rep.ops == "stock" and _patched(vae) == []
    with torch.no_grad():
        got, _ = chunked_decode(vae, z)
    assert_same(got, want)
    with pytest.raises(P.FastPathError, match="0.37.1"):
        P.prepare_decoder(vae, kernels="triton")
    monkeypatch.setattr(diffusers, "__version__", "0.42.1")
    rep = P.prepare_decoder(vae, layout="contiguous", ops=P.REFERENCE_OPS)
    assert rep.stock_reason is None and _patched(vae)


def test_table_names_only_known_ops() -> None:
    from vaed.patches.table import ops_used

    assert set(ops_used()) == set(P.OP_NAMES)
    assert {row.cls for row in P.PATCH_TABLE} == {
        "WanCausalConv3d", "WanDecoder3d", "WanResidualBlock", "WanResample", "WanUpBlock", "WanResidualUpBlock",
        "WanEncoder3d", "WanResidualDownBlock",
    }  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "time_major"])
def test_unpadded_shortcut_input_is_the_activation_itself(layout: str) -> None:
    """A 1x1x1 shortcut conv's input (no padding, no cache) is F.pad's clone of x, which keeps
    x's strides when x is dense in any dimension order, so x itself is passed on. A spatial
    shard's resample output is (B, T, C, H, W) in memory: it took the reference's copy before."""
    from vaed.kernels.causal_input import causal_pad_reference
    from vaed.patches.ops import triton_causal_pad

    x = torch.randn(1, 2, 6, 4, 5)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last_3d)
    elif layout == "time_major":
        x = torch.randn(1, 2, 6, 4, 5).permute(0, 2, 1, 3, 4)  # [B, C, T, H, W] over (B, T, C, H, W) memory
    got = triton_causal_pad(x, None, (0, 0, 0, 0, 0, 0), emit_cache=False)
    want, _ = causal_pad_reference(x, None, (0, 0, 0, 0, 0, 0), emit_cache=False)
    assert got is not None and got[0] is x and got[1] is None
    assert got[0].stride() == want.stride() and torch.equal(got[0], want)


def test_a_strided_view_is_not_passed_on_as_shortcut_input() -> None:
    from vaed.patches.ops import triton_causal_pad

    x = torch.randn(1, 6, 2, 4, 10)[..., ::2]  # not dense: F.pad's clone has other strides
    got = triton_causal_pad(x, None, (0, 0, 0, 0, 0, 0), emit_cache=False)
    assert got is None or got[0] is not x


# --- the fast tier's unfolded conv weight -----------------------------------------------


def test_unfolded_weight_turns_a_conv3d_into_a_conv2d_over_unfolded_taps() -> None:
    """conv2d(time taps stacked on channels, unfolded weight) == conv3d, against a naive unfolding in fp64."""
    import torch.nn.functional as F

    from vaed.patches.fast import unfolded_weight

    g = torch.Generator().manual_seed(0)
    conv = torch.nn.Conv3d(4, 4, 3).double()
    with torch.no_grad():
        conv.weight.copy_(torch.randn(conv.weight.shape, generator=g, dtype=torch.float64))
    padded = torch.randn(2, 4, 5, 6, 7, generator=g, dtype=torch.float64)  # B, C, TP, HP, WP
    images = torch.stack([torch.cat([padded[:, :, t + k] for k in range(3)], 1) for t in range(3)], 1).flatten(0, 1)
    got = F.conv2d(images, unfolded_weight(conv), conv.bias).unflatten(0, (2, 3)).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(got, F.conv3d(padded, conv.weight, conv.bias), rtol=1e-12, atol=1e-12)


def test_unfolded_weight_is_cached_until_the_weight_changes() -> None:
    from vaed.patches.fast import unfolded_weight

    conv = torch.nn.Conv3d(2, 2, 3)
    first = unfolded_weight(conv)
    assert unfolded_weight(conv) is first
    with torch.no_grad():
        conv.weight.mul_(2)  # in place (what load_state_dict does): the version moves
    second = unfolded_weight(conv)
    assert second is not first and torch.equal(second, first * 2)
    conv.weight = torch.nn.Parameter(torch.ones_like(conv.weight))  # replaced
    assert torch.equal(unfolded_weight(conv), torch.ones(2, 6, 3, 3))


def test_derived_values_are_kept_until_a_source_changes() -> None:
    """The summed biases of a residual add: built once per module, rebuilt when a source tensor
    is replaced or changed in place, kept apart per name and per module."""
    from vaed.patches.derived import derived

    block, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    a, b = torch.ones(3), torch.full((3,), 2.0)
    builds: list[int] = []

    def total() -> torch.Tensor:
        builds.append(1)
        return a + b

    first = derived(block, "sum", (a, b), total)
    assert torch.equal(first, torch.full((3,), 3.0)) and derived(block, "sum", (a, b), total) is first
    assert len(builds) == 1
    a.add_(1.0)  # in place: a new version
    assert torch.equal(derived(block, "sum", (a, b), total), torch.full((3,), 4.0)) and len(builds) == 2
    b = torch.zeros(3)  # replaced
    assert torch.equal(derived(block, "sum", (a, b), total), torch.full((3,), 2.0)) and len(builds) == 3
    derived(other, "sum", (a, b), total)
    derived(block, "other", (a, b), total)
    assert len(builds) == 5


def test_unfolded_weight_of_an_inference_tensor_is_cached_by_identity() -> None:
    """Convs built under inference_mode (the start-up checks') have no version counter."""
    from vaed.patches.fast import unfolded_weight

    with torch.inference_mode():
        conv = torch.nn.Conv3d(2, 2, 3)
        first = unfolded_weight(conv)
        assert unfolded_weight(conv) is first and first.shape == (2, 6, 3, 3)


def test_biases_are_deferred_only_where_the_fused_kernels_run() -> None:
    """A CPU tensor without the Triton interpreter: every fused kernel declines, so both tiers
    keep each conv's bias in the conv. The fast tier defers at every site; the lossless one only
    where its reader rounds as the conv's own bias pass (conv2, the time_conv, Wan2.2's
    upsampler); the plain-torch set never."""
    x = torch.randn(1, 4, 1, 2, 2)
    assert P.FAST_OPS.defer_bias == ALL_BIAS_SITES == frozenset(BiasSite)
    assert P.LOSSLESS_OPS.defer_bias == EXACT_BIAS_SITES == {
        BiasSite.CONV2_RESIDUAL, BiasSite.TIME_CONV_UPSAMPLE, BiasSite.IMAGE_CONV_DUPUP
    }
    assert not P.REFERENCE_OPS.defer_bias
    assert P.FAST_OPS.deferred_bias_sites(x) == frozenset()
    assert P.LOSSLESS_OPS.deferred_bias_sites(x) == frozenset()


def _bias_counting_ops(seen: collections.Counter, *, separate_bias: bool = False) -> dict[str, Any]:
    """OpSet fields: the plain-torch ops, each counting into ``seen`` the calls that leave a
    conv's bias out or hand one on. ``separate_bias``: convs add their bias in an aten pass
    of their own after the conv, as torch does after a cuDNN conv (a CPU conv adds it in its sum)."""

    def conv(op: Any, kind: str) -> Any:
        def run(module: Any, x: torch.Tensor, *, bias: bool = True) -> torch.Tensor:
            seen[f"{kind} without bias"] += not bias
            if not separate_bias:
                return op(module, x, bias=bias)
            y = op(module, x, bias=False)
            if bias and module.bias is not None:
                y = y + module.bias.view(1, -1, *([1] * (y.dim() - 2)))
            return y

        return run

    def norm_causal_pad(x: torch.Tensor, cache: Any, pad: Any, **kw: Any) -> Any:
        seen["norm with x_bias"] += kw["norm"].x_bias is not None
        return P.REFERENCE_OPS.norm_causal_pad(x, cache, pad, **kw)

    def residual_add(x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen["residual add with bias"] += bias is not None
        return P.REFERENCE_OPS.residual_add(x, h, bias)

    def dupup_add(*args: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen["dupup add with bias"] += bias is not None
        return P.REFERENCE_OPS.dupup_add(*args, bias=bias)

    def upsample(x: torch.Tensor, interleave: bool = False, bias: torch.Tensor | None = None) -> torch.Tensor:
        seen["upsample with bias"] += bias is not None
        return P.REFERENCE_OPS.upsample2x(x, interleave, bias)

    return dict(
        conv3d=conv(P.REFERENCE_OPS.conv3d, "conv3d"), conv2d=conv(P.REFERENCE_OPS.conv2d, "conv2d"),
        norm_causal_pad=norm_causal_pad, residual_add=residual_add, dupup_add=dupup_add,
        upsample=upsample, upsample_interleave=upsample,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_deferred_biases_reach_the_ops_that_read_the_conv_outputs(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference ops with ``defer_bias`` forced on (fp64): every residual block runs conv1,
    conv2 and a conv shortcut without their bias, norm2 gets conv1's as ``x_bias`` and the
    residual add the rest; every upsampler's image conv runs without its bias, which reaches
    the next block's norm1 and residual add (Wan2.1) or the DupUp3D add (Wan2.2). The decode
    equals stock up to fp64 rounding (the biases are added where the next op reads)."""
    from vaed.patches import ops as ops_module

    vae = _vae(arch, torch.float64)
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4, dtype=torch.float64)
    with torch.no_grad():
        want, _ = chunked_decode(vae, z)
    seen: collections.Counter = collections.Counter()
    deferring = dataclasses.replace(
        P.REFERENCE_OPS, name="deferring", exact=False, uses_triton=True, defer_bias=ALL_BIAS_SITES,
        **_bias_counting_ops(seen),
    )
    monkeypatch.setattr(ops_module.rt, "triton_available", lambda: True)
    monkeypatch.setattr(ops_module.rt, "device_ok", lambda t: True)
    decoder = vae.decoder
    blocks = [m for m in decoder.modules() if type(m).__name__ == "WanResidualBlock"]
    conv_shortcuts = sum(1 for b in blocks if type(b.conv_shortcut).__name__ == "WanCausalConv3d")
    upsamplers = sum(1 for m in decoder.modules() if type(m).__name__ == "WanResample")
    wan21 = type(decoder.up_blocks[0]).__name__ == "WanUpBlock"
    time_convs = sum(1 for m in decoder.modules() if getattr(m, "mode", None) == "upsample3d")
    assert conv_shortcuts >= 1 and upsamplers == 3 and time_convs >= 1
    with torch.no_grad():
        P.prepare_decoder(vae, layout="contiguous", ops=P.REFERENCE_OPS)
        with P.using(deferring):
            got, _ = chunked_decode(vae, z)
    chunks = z.shape[2]
    expect = {  # a time_conv runs from the second chunk on (the first leaves diffusers' "Rep")
        "conv3d without bias": (2 * len(blocks) + conv_shortcuts) * chunks + time_convs * (chunks - 1),
        "conv2d without bias": upsamplers * chunks,
        "norm with x_bias": (len(blocks) + (upsamplers if wan21 else 0)) * chunks,
        "residual add with bias": len(blocks) * chunks,
        "dupup add with bias": 0 if wan21 else upsamplers * chunks,
        "upsample with bias": time_convs * (chunks - 1),
    }
    assert seen == {k: n for k, n in expect.items() if n}, seen
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("arch", ARCHS)
def test_exact_deferred_biases_keep_stock_bits(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The lossless tier's sites (bf16): convs that add their bias in a pass of their own (as
    torch does after a cuDNN conv), and the plain-torch readers. Deferring at EXACT_BIAS_SITES
    gives the very bytes of not deferring -- conv2's bias reaches the residual add (alone:
    a shortcut's is added to the shortcut first), the time_conv's the upsample gather, Wan2.2's
    upsampler's the DupUp3D add -- and no norm is handed a bias."""
    from vaed.patches import ops as ops_module

    vae = _vae(arch, torch.bfloat16)
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4).to(torch.bfloat16)
    seen: collections.Counter = collections.Counter()
    keeping = dataclasses.replace(
        P.REFERENCE_OPS, name="keeping", uses_triton=True, **_bias_counting_ops(seen, separate_bias=True)
    )
    deferring = dataclasses.replace(keeping, name="deferring", defer_bias=EXACT_BIAS_SITES)
    monkeypatch.setattr(ops_module.rt, "triton_available", lambda: True)
    monkeypatch.setattr(ops_module.rt, "device_ok", lambda t: True)
    monkeypatch.setattr(ops_module, "conv_bias_added_separately", lambda t: True)  # as separate_bias does
    decoder = vae.decoder
    blocks = [m for m in decoder.modules() if type(m).__name__ == "WanResidualBlock"]
    time_convs = sum(1 for m in decoder.modules() if getattr(m, "mode", None) == "upsample3d")
    upsamplers = sum(1 for m in decoder.modules() if type(m).__name__ == "WanResample")
    wan21 = type(decoder.up_blocks[0]).__name__ == "WanUpBlock"
    with torch.no_grad():
        P.prepare_decoder(vae, layout="channels_last", ops=P.REFERENCE_OPS)
        with P.using(keeping):
            want, want_cache = chunked_decode(vae, z)
        assert not +seen, seen  # not deferring: every bias in its conv (zero counts dropped)
        with P.using(deferring):
            got, got_cache = chunked_decode(vae, z)
    chunks = z.shape[2]
    expect = {
        "conv3d without bias": len(blocks) * chunks + time_convs * (chunks - 1),
        "conv2d without bias": 0 if wan21 else upsamplers * chunks,
        "residual add with bias": len(blocks) * chunks,
        "upsample with bias": time_convs * (chunks - 1),
        "dupup add with bias": 0 if wan21 else upsamplers * chunks,
    }
    assert +seen == {k: n for k, n in expect.items() if n}, seen
    assert_same(got, want)
    assert_same_cache(got_cache, want_cache)


# --- the one decoder tree ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_the_tree_walked_directly_on_a_stock_decoder_equals_stock(arch: str) -> None:
    """The tree never asks which forward a module has bound: walked from the decoder with the
    plain-torch ops on an unpatched decoder (what a shard does), every call equals stock's,
    bit for bit, and writes the same cache list."""
    from vaed.patches import tree

    vae = _vae(arch)
    z = torch.randn(1, vae.config.z_dim, 3, 4, 4)
    with torch.no_grad():
        want, want_cache = chunked_decode(vae, z)
        assert _patched(vae) == []
        x = vae.post_quant_conv(z)
        cache: list = [None] * len(want_cache)
        got = torch.cat([tree.decode(P.REFERENCE_OPS, vae.decoder, x[:, :, i : i + 1], cache, i == 0, strict=True)
                         for i in range(x.shape[2])], 2)
    assert_same(got, want)
    assert_same_cache(cache, want_cache)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "time_major", "strided"])
def test_an_up_blocks_shortcut_reads_its_input_itself_where_stocks_clone_keeps_strides(layout: str) -> None:
    """Stock clones a residual up block's input for its DupUp3D shortcut; nothing below writes
    into it, so where the clone keeps the strides (dense in any dim order: Wan2.2's NTCHW input
    after an upsampler too) the shortcut reads the input itself, and only a view with gaps is
    copied. The block's output and cache equal stock's, bit for bit, either way."""
    from vaed.patches import tree

    vae = _vae("wan2.2-tiny")
    up = vae.decoder.up_blocks[1]
    c = up.resnets[0].norm1.gamma.numel()
    base = torch.randn(1, c, 3, 4, 6)
    x = {
        "contiguous": base,
        "channels_last": base.contiguous(memory_format=torch.channels_last_3d),
        "time_major": base.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4),  # NTCHW memory
        "strided": torch.randn(1, c, 3, 4, 12)[..., ::2],
    }[layout]
    sources: list[torch.Tensor] = []

    def spy(main: torch.Tensor, source: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        sources.append(source)
        return P.REFERENCE_OPS.dupup_add(main, source, *args, **kwargs)

    ops = dataclasses.replace(P.REFERENCE_OPS, dupup_add=spy)
    first = torch.randn(1, c, 1, 4, 6)  # a first chunk fills the caches; the call judged is the next
    with torch.no_grad():
        want_cache: list = [None] * 16
        up(first, feat_cache=want_cache, feat_idx=[0], first_chunk=True)
        want = up(x, feat_cache=want_cache, feat_idx=[0], first_chunk=False)
        cache: list = [None] * 16
        for chunk, is_first in ((first, True), (x, False)):
            got = tree.residual_up_block(tree.Walk(ops, cache, [0], is_first, defer=frozenset()), up, tree.Act(chunk))
    assert len(sources) == 2
    assert (sources[1] is x) == (layout != "strided")
    assert got.bias is None
    assert_same(got.x, want)
    assert_same_cache(cache, want_cache)


def test_clone_keeps_strides_of_every_dense_layout_and_of_no_view_with_gaps() -> None:
    from vaed.patches.layout import clone_keeps_strides, is_dense

    t = torch.randn(2, 3, 1, 4, 5)
    dense = [t, t.contiguous(memory_format=torch.channels_last_3d), t.permute(0, 2, 1, 3, 4).contiguous(),
             t.permute(0, 2, 1, 3, 4).contiguous().permute(0, 2, 1, 3, 4), t.transpose(3, 4)]
    for d in dense:
        assert clone_keeps_strides(tuple(d.shape), d.stride())
    assert is_dense(t) and clone_keeps_strides(tuple(t.shape), t.stride())
    for gappy in (t[..., ::2], t[:, :2], torch.randn(3, 1).expand(3, 4)):
        assert not clone_keeps_strides(tuple(gappy.shape), gappy.stride())


def test_a_strict_walk_refuses_a_module_the_tree_does_not_port() -> None:
    """A subclass may override the very forward a body mirrors: a strict walk (a shard's) raises
    instead of calling a module that would exchange no halo; a lenient one calls it as stock."""
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    from vaed.patches import tree

    class Block(W.WanResidualBlock):
        pass

    vae = _vae("wan2.1-tiny")
    z = torch.randn(1, vae.config.z_dim, 1, 4, 4)
    with torch.no_grad():
        want, _ = chunked_decode(vae, z)
        mid = vae.decoder.mid_block
        mid.resnets[0].__class__ = Block
        n = len(chunked_decode(vae, z)[1])
        x = vae.post_quant_conv(z)
        with pytest.raises(TypeError, match="Block is not a module the decoder tree ports"):
            tree.decode(P.REFERENCE_OPS, vae.decoder, x, [None] * n, True, strict=True)
        got = tree.decode(P.REFERENCE_OPS, vae.decoder, x, [None] * n, True)
    assert_same(got, want)


def test_norm_arguments_are_one_dataclass() -> None:
    """The references, the exact prologue and the fast one take the same NormSilu: a pending conv
    bias rides on it, and the reference adds it before the norm as the conv would have."""
    from vaed import kernels as K

    assert P.NormSilu is K.NormSilu
    g = torch.Generator().manual_seed(0)
    x, xb = torch.randn(1, 4, 2, 3, 5, generator=g), torch.randn(4, generator=g)
    gamma = torch.rand(4, 1, 1, 1, generator=g) + 0.5
    got = K.causal_pad_reference(x, None, (1, 1, 1, 1, 2, 0), norm=K.NormSilu(gamma, 2.0, 0.0, xb))
    want = K.causal_pad_reference(x + xb.view(1, -1, 1, 1, 1), None, (1, 1, 1, 1, 2, 0), norm=K.NormSilu(gamma, 2.0, 0.0))
    assert_same(got[0], want[0])
    assert_same(got[1], want[1])
