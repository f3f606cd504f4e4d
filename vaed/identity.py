"""What decides the bits of a server's frames (and latents), as the line a client compares.

A call resumed on another replica (`vaed_client.resume`) joins the frames of two servers, which
is only right when both compute the same bits. An `EngineIdentity` holds what decides them,
taken once when the engine is built (the weights' digest when the model is loaded, see
`vaed.models.weights_digest`); `decoder(precision)` and `encoder()` are its lines, in
ModelInfo and in each call's initial metadata (`vaed_client.wire.DECODER_IDENTITY_HEADER`).

Parts of the decoder's line, `name=value; ...` (`vaed_client.wire.identity_line`):

* weights: the decoder half's digest (config and tensors), 16 hex digits of its sha256;
* dtype: the compute dtype;
* precision: the tier of a call that asks for none, the server's --precision (the client's
  decode names none);
* kernels and layout: the fast paths installed and the weights' memory layout (lossless frames
  are stock diffusers' bits with the same layout);
* device: "cpu" or the GPU's name: one GPU type computes the bits another may not;
* parallel: "off", or the spatial group (sharded frames are within a tolerance of one GPU's);
* disabled: the fused ops switched off, for a fast default tier only (the lossless ops are
  bit-exact against the aten chain they replace, so they change no lossless bit);
* software: the torch (with its CUDA), cuDNN and diffusers versions, whose kernels and choices of
  kernel make stock's bits; with a fast default tier also vaed's, whose own kernels make the
  fast tier's (a replica upgraded in a rolling update computes the same call otherwise).

What it leaves out: the fast tier's cuDNN plans (`--conv-plans`: per plan file, within the tier's
tolerance), so replicas serving the fast tier by default should share one kernel cache. A server's
line is its first healthy device's (`CallCore.identities`): the header goes out before a call is
admitted to a device, and the devices of one server load one model alike (one GPU model per host).

The encoder's line has the encoder half's digest, the default encode dtype, its tier (lossless),
the kernels and layout of that dtype's copy, the device and the software.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from vaed_client.wire import identity_line

from . import __version__
from .choices import Parallel, Precision
from .patches.versions import installed_diffusers_version

DIGEST_CHARS = 16  # of the sha256's 64 hex digits: 64 bits tell two weight sets apart


def device_kind(device: torch.device) -> str:
    """"cpu", or a CUDA device's name ("NVIDIA H200"): what its bits depend on, not its index."""
    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return device.type


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def software_versions() -> str:
    """"torch 2.11.0+cu130, cudnn 91900, diffusers 0.42.1": the libraries whose kernels decide
    stock diffusers' bits (cudnn "none" on a torch without it)."""
    return (f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version() or 'none'}, "
            f"diffusers {installed_diffusers_version() or 'none'}")


@dataclass(frozen=True)
class EngineIdentity:
    """What decides an engine's bits (see the module doc); one engine's, built once."""

    weights: str                        # the decoder half's sha256 (hex)
    dtype: torch.dtype
    kernels: str
    layout: str
    device: str                         # `device_kind`
    parallel: str = Parallel.OFF
    software: str = dataclasses.field(default_factory=software_versions)
    disabled_ops: tuple[str, ...] = ()  # the decoder's fused ops switched off
    encoder_weights: str | None = None  # the encoder half's sha256; None without an encoder
    encode_dtype: torch.dtype | None = None  # the default encode dtype
    encoder_kernels: str = ""
    encoder_layout: str = ""

    def decoder(self, precision: str) -> str:
        """The decoder's line for a server whose calls that ask for no tier get `precision`."""
        parts = [("weights", f"sha256:{self.weights[:DIGEST_CHARS]}"), ("dtype", dtype_name(self.dtype)),
                 ("precision", str(precision)), ("kernels", str(self.kernels)), ("layout", str(self.layout)),
                 ("device", self.device), ("parallel", self.parallel)]
        if precision != Precision.LOSSLESS and self.disabled_ops:
            parts.append(("disabled", ",".join(self.disabled_ops)))
        fast_kernels = f", vaed {__version__}" if precision != Precision.LOSSLESS else ""
        parts.append(("software", self.software + fast_kernels))
        return identity_line(parts)

    def encoder(self) -> str:
        """The encoder's line; "" for an engine without an encoder."""
        if self.encoder_weights is None or self.encode_dtype is None:
            return ""
        return identity_line([
            ("weights", f"sha256:{self.encoder_weights[:DIGEST_CHARS]}"), ("dtype", dtype_name(self.encode_dtype)),
            ("precision", str(Precision.LOSSLESS)), ("kernels", str(self.encoder_kernels)),
            ("layout", str(self.encoder_layout)), ("device", self.device), ("software", self.software),
        ])
