"""The identity line a server sends with each call (`vaed.identity`): what a resuming client
compares. These check which parts it holds for which tier; tests/chaos/test_replica_identity.py
checks it between real replicas."""

from __future__ import annotations

import dataclasses

import diffusers
import torch

import vaed
from vaed.identity import EngineIdentity
from vaed_client import wire

IDENTITY = EngineIdentity(weights="ab" * 32, dtype=torch.bfloat16, kernels="triton", layout="channels_last",
                          device="NVIDIA H200", encoder_weights="cd" * 32, encode_dtype=torch.float32,
                          encoder_kernels="off", encoder_layout="contiguous")


def test_the_lossless_line_names_stocks_software_and_not_vaeds() -> None:
    parts = wire.identity_parts(IDENTITY.decoder("lossless"))
    assert parts == {
        "weights": "sha256:abababababababab", "dtype": "bfloat16", "precision": "lossless", "kernels": "triton",
        "layout": "channels_last", "device": "NVIDIA H200", "parallel": "off",
        "software": f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version() or 'none'}, "
                    f"diffusers {diffusers.__version__}",
    }


def test_a_fast_default_tier_adds_vaeds_version_and_the_disabled_ops() -> None:
    """The fast tier's bits are vaed's own kernels': another vaed version, or an op switched off,
    is another decoder there (and not for lossless, whose fused ops give stock's bits)."""
    disabled = dataclasses.replace(IDENTITY, disabled_ops=("norm",))
    lossless, fast = (wire.identity_parts(disabled.decoder(p)) for p in ("lossless", "fast"))
    assert fast["software"] == lossless["software"] + f", vaed {vaed.__version__}"
    assert fast["disabled"] == "norm" and "disabled" not in lossless
    assert {k for k in fast if fast[k] != lossless.get(k)} == {"precision", "software", "disabled"}


def test_the_encoder_line_is_its_own_half() -> None:
    parts = wire.identity_parts(IDENTITY.encoder())
    assert parts["weights"] == "sha256:cdcdcdcdcdcdcdcd" and parts["dtype"] == "float32"
    assert parts["precision"] == "lossless" and parts["kernels"] == "off" and parts["layout"] == "contiguous"
    assert parts["software"] == wire.identity_parts(IDENTITY.decoder("lossless"))["software"]
    assert dataclasses.replace(IDENTITY, encoder_weights=None).encoder() == ""


def test_a_fast_default_where_there_is_no_fast_tier_is_lossless_and_said_so() -> None:
    """`vaed serve --precision fast` on a CPU (no fast tier: its kernels need CUDA) warns at
    start-up and serves, offers and names in its identity the lossless tier, not a fast tier it
    does not have (it said precision=fast, put vaed's version in the line, and took fast calls)."""
    import grpc
    import pytest

    from harness import decode_rpc, start_serve
    from vaed_client import VaeClient

    proc, target, lines = start_serve("--precision", "fast")
    try:
        assert any("--precision fast: this server has no fast tier" in line for line in lines), "".join(lines)
        with VaeClient(target) as client:
            info = client.model_info()
        assert info.precisions == ["lossless"]
        parts = wire.identity_parts(info.decoder_identity)
        assert parts["precision"] == "lossless" and "vaed" not in parts["software"], parts
        latents = torch.randn(1, 4, 2, 4, 4)
        assert decode_rpc(target, latents) == 5
        with grpc.insecure_channel(target) as channel:
            options = wire.pb.DecodeOptions(precision=wire.pb.FAST)
            request = wire.pb.DecodeRequest(latents=wire.to_message(latents), options=options)
            with pytest.raises(grpc.RpcError) as refused:
                list(wire.pb_grpc.VaeDecoderStub(channel).Decode(request, timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "precision fast is not offered by this server; it offers lossless" in refused.value.details()
    finally:
        proc.kill()
        proc.wait(30)
