"""benchmarks/roofline.py on the CPU: its counts of bytes and FLOPs, and that recording a chunk's
ops changes nothing the decoder computes. GPU times are the device's; here they are zero."""

from __future__ import annotations

import pytest
import torch
from harness import load_script

from vaed import patches as P
from vaed.models import build_random_vae

R = load_script("benchmarks/roofline.py")


def test_a_conv_call_costs_its_operands_and_its_multiply_adds() -> None:
    conv = torch.nn.Conv3d(4, 6, (3, 3, 3), bias=True)
    x = torch.randn(1, 4, 5, 7, 9)
    y = conv(x)  # [1, 6, 3, 5, 7]
    moved, flops = R.call_cost((conv, x), {}, y)
    weight_bytes = 6 * 4 * 27 * 4
    assert moved == x.numel() * 4 + y.numel() * 4 + weight_bytes + 6 * 4
    assert flops == 2 * (6 * 3 * 5 * 7) * (4 * 27)
    # the bias left out of the call is not read by it
    moved_no_bias, _ = R.call_cost((conv, x), {"bias": False}, y)
    assert moved_no_bias == moved - 6 * 4
    grouped = torch.nn.Conv2d(8, 8, 3, groups=4)
    y2 = grouped(torch.randn(2, 8, 6, 6))
    assert R.call_cost((grouped, torch.randn(2, 8, 6, 6)), {}, y2)[1] == 2 * y2.numel() * (2 * 9)


def test_other_ops_cost_their_tensors_and_no_flops() -> None:
    x, cache = torch.randn(1, 8, 4, 5, 5, dtype=torch.bfloat16), torch.randn(1, 8, 2, 5, 5, dtype=torch.bfloat16)
    padded, nxt = torch.randn(1, 8, 6, 7, 7, dtype=torch.bfloat16), x[:, :, -2:]
    moved, flops = R.call_cost((x, cache, (1, 1, 1, 1, 2, 0)), {"zero_history": False}, (padded, nxt))
    assert moved == 2 * (x.numel() + cache.numel() + padded.numel())  # nxt views x: not written
    assert flops == 0
    assert R.op_key("causal_pad", (x, cache), (padded, nxt)) == "causal_pad C8 @4x5x5"
    assert R.op_key("conv3d", (torch.nn.Conv3d(8, 16, (3, 1, 1)), padded), torch.zeros(1, 16, 4, 7, 7)) == (
        "conv3d 8->16 k3x1x1 @4x7x7")


def test_rows_sum_each_keys_calls() -> None:
    rows = R.rows_from([("a", 10, 0, 0.001), ("b", 5, 100, 0.004), ("a", 10, 0, 0.002)])
    assert [(r.key, r.calls, r.bytes, r.flops, round(r.seconds, 6)) for r in rows] == [
        ("b", 1, 5, 100, 0.004), ("a", 2, 20, 0, 0.003)]


def test_a_result_that_views_an_operand_is_not_counted_as_written() -> None:
    x = torch.randn(1, 8, 4, 5, 5)
    padded = torch.randn(1, 8, 6, 5, 5)
    moved, _ = R.call_cost((x, None), {}, (padded, x[:, :, -2:]))  # the next cache cut from x
    assert moved == 4 * (x.numel() + padded.numel())


def test_a_recorded_chunk_is_the_chunk_and_every_op_call_is_timed() -> None:
    vae = build_random_vae("wan2.2-tiny").eval().requires_grad_(False)
    P.prepare_decoder(vae, layout="contiguous", ops=P.REFERENCE_OPS)
    z = torch.randn(1, vae.config.z_dim, 6, 4, 4)
    rows, total = R.profile_steady_chunk(vae, z, P.REFERENCE_OPS)
    assert total > 0 and 0 < sum(r.seconds for r in rows) <= total  # the host clock here
    names = {r.key.split(" ")[0] for r in rows}
    assert {"conv3d", "conv2d", "causal_pad", "residual_add", "upsample_interleave", "dupup_add"} <= names
    assert all(r.calls > 0 and r.bytes > 0 for r in rows if "declined" not in r.key)
    assert all(r.flops > 0 for r in rows if r.key.startswith("conv"))
    # the op set as recorded gives the chunk's own bytes
    recorder = R.Recorder(cuda=False)
    traced = recorder.instrument(P.REFERENCE_OPS)
    x = vae.post_quant_conv(z)
    n_convs = sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")
    with torch.inference_mode():
        plain_cache: list = [None] * n_convs
        traced_cache: list = [None] * n_convs
        for i in range(x.shape[2]):
            frame = x[:, :, i:i + 1]
            with P.using(P.REFERENCE_OPS):
                want = vae.decoder(frame, feat_cache=plain_cache, feat_idx=[0], first_chunk=i == 0)
            with P.using(traced):
                got = vae.decoder(frame, feat_cache=traced_cache, feat_idx=[0], first_chunk=i == 0)
            assert torch.equal(got, want)
    assert recorder.calls
