"""The fused kernels run on shards: the shard forward with the lossless op set under
TRITON_INTERPRET=1 on the CPU (a subprocess: the interpreter is chosen when a kernel is first
decorated). Every conv-input build must be taken by the kernel (none falls back to the
reference chain), and the result must match the plain-torch shard forward."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # the interpreter runs every launch in numpy

SCRIPT = textwrap.dedent(
    """
    import torch, torch.distributed as dist
    from vaed import kernels as K
    from vaed.engine import DecodeEngine
    from vaed.parallel.forward import ShardContext, decoder_forward
    from vaed.parallel.inner_ops import ATEN_OPS, resolve_inner_ops
    from vaed.parallel.plan import ShardPlan
    assert K.interpreter_active()
    calls = []
    real = K.causal_pad
    def counting(*a, **k):
        out = real(*a, **k)
        calls.append(out is not None)
        return out
    K.causal_pad = counting
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
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
                decoder_forward(ctx, engine.vae.decoder, engine.vae.post_quant_conv(z[:, :, i : i + 1]), cache, i == 0)
                for i in range(2)
            ]
    n_fused = len(calls)
    assert n_fused > 20 and all(calls), (n_fused, calls.count(False))
    diff = max((a - b).abs().max().item() for a, b in zip(outs["fused"], outs["aten"]))
    assert diff <= 1e-4, diff
    print("OK", n_fused, diff)
    """
)


def test_lossless_kernels_take_every_shard_conv_input() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], check=False, capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
