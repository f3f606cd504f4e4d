"""What a decode engine is: the one interface the device worker, the service and the benchmarks use.

Two engines implement it: `vaed.engine.DecodeEngine` (one device) and
`vaed.parallel.ShardedEngine` (rank 0 of a group of devices, one video split
across them). Both subclass `Engine` explicitly, so what the server may read
is written here and nowhere else; nothing is forwarded by attribute lookup.

Shared here, written once:

- the model facts (`z_dim`, scale factors, `latents_mean/std`, ...), read
  from the loaded model's config by `ModelFacts.of`;
- input preparation (`LatentInput`): to the device and compute dtype, then
  WanPipeline's denormalization, with constants built the way it builds them;
- output postprocessing (`Engine.finish`): unpatchify (Wan2.2), clamp, then
  the wire layout (`postprocess`);
- `decode_video`, the served per-frame loop concatenated.

An engine decodes one latent frame per call (`decode_frame`) into a
`DecodedGroup` on its device; `state` objects are the engine's own (its
cache list and position).

Encoding is the method pair `new_encode_state` / `encode_frames`. Frames may
arrive in pieces of any length (a client stream); the causal encoder takes
frame 0 alone, then `scale_temporal` frames per call, each call giving one
latent frame, so `encode_frames` buffers what does not fill a call yet and
runs every call that is full (`encode_call`, the engine's one hook). Fed in
any pieces, the calls see the same frames as `AutoencoderKLWan._encode`'s
loop, hence the same bytes; `end_encode` refuses a video whose frame count is
not 1 + 4k. An engine that cannot encode (decode-only weights) says so in
`encodes` and its `encode_call` raises.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vaed_client import wire

from .choices import Parallel, Precision
from .identity import EngineIdentity


@dataclass(frozen=True)
class OutputSpec:
    rgb8: bool                      # True: uint8 [B, t, H, W, 3]; False: RAW [B, 3, t, H, W]
    raw_dtype: torch.dtype | None   # RAW only; None = compute dtype
    raw_latents: bool               # True: latents already in VAE space
    precision: str = Precision.LOSSLESS  # op set tier
    allow_non_finite: bool = False  # False: NaN/Inf latents are refused
    # RGB8 only: the session turns each group into yuv420p planes [B, t, 3H/2, W] on the device
    # (`vaed.yuv`), for H.264 video; the engine itself always makes RGB8
    yuv420p: bool = False

    @property
    def time_dim(self) -> int:
        return 1 if self.rgb8 else 2


@dataclass(frozen=True)
class DecodedGroup:
    """Frames of one decoder call, postprocessed, still on the device."""

    chunk_index: int
    first_frame: int
    frames: torch.Tensor


@dataclass(frozen=True)
class EncodeSpec:
    """What an encode returns: the moments (quant_conv's output, mean and log-variance stacked on
    the channel dim, as DiagonalGaussianDistribution takes them) and, with `latents`, the
    normalised latents (mean - latents_mean) / latents_std as the Wan pipelines compute them."""

    latents: bool = False           # also the normalised latents
    out_dtype: torch.dtype | None = None  # None: the encoder's compute dtype
    precision: str = Precision.LOSSLESS  # op set tier
    allow_non_finite: bool = False  # False: NaN/Inf frames are refused
    dtype: torch.dtype | None = None  # the encode's compute dtype (Engine.encode_dtypes); None: the first


def rgb8_to_video_reference(frames: torch.Tensor) -> torch.Tensor:
    """uint8 frames in video layout [B, 3, t, H, W] (a permuted view of the wire's [B, t, H, W, 3])
    -> float32 in [-1, 1] the way diffusers' VideoProcessor makes them on the CPU: x / 255, then
    2x - 1."""
    return (frames.to(torch.float32) / 255.0) * 2.0 - 1.0


# The 256 values of rgb8_to_video_reference, computed once on the CPU.
_RGB8_VALUES = rgb8_to_video_reference(torch.arange(256, dtype=torch.uint8))
_rgb8_tables: dict[torch.device, torch.Tensor] = {}


def rgb8_to_video(frames: torch.Tensor) -> torch.Tensor:
    """`rgb8_to_video_reference`'s bits on any device: a lookup in its 256 CPU-computed values.
    So uint8 frames cross to the GPU at 1 byte a value and are converted there; the formula run
    on CUDA would round differently (a division by a Python scalar becomes a multiplication by
    its reciprocal)."""
    table = _rgb8_tables.get(frames.device)
    if table is None:
        table = _rgb8_tables.setdefault(frames.device, _RGB8_VALUES.to(frames.device))
    return table[frames.long()]


@dataclass(frozen=True)
class EncodedGroup:
    """One encoder call's latent frame, still on the device."""

    latent_frame: int
    moments: torch.Tensor           # [B, 2 * z_dim, 1, h, w]
    latents: torch.Tensor | None    # [B, z_dim, 1, h, w] when EncodeSpec.latents


@dataclass
class EncodeState:
    """One video's encoder cache, the frames waiting for a whole encoder call, and position."""

    cache: list[Any] | None
    pending: list[torch.Tensor] = field(default_factory=list)  # [B, 3, t, H, W] pieces
    pending_frames: int = 0
    frames_in: int = 0
    next_latent_frame: int = 0


@dataclass
class EngineInfo:
    """What ModelInfo reports about an engine."""

    model: str
    random_weights: bool
    device: str
    dtype: torch.dtype
    kernels: str
    layout: str
    fast_paths_note: str
    precisions: tuple[str, ...] = field(default=(Precision.LOSSLESS,))


@dataclass(frozen=True)
class ModelFacts:
    """The model's numbers every engine reports, from the VAE's config."""

    z_dim: int
    scale_temporal: int
    scale_spatial: int
    patch_size: int | None
    latents_mean: list[float]
    latents_std: list[float]
    num_convs: int  # the decoder's causal convs: the length of its cache list
    encoder_convs: int = 0  # the encoder's (0: not loaded)

    @classmethod
    def of(cls, vae: Any) -> ModelFacts:
        cfg = vae.config
        # diffusers counts at construction; a decode-only load drops the encoder afterwards
        encoder_convs = vae._cached_conv_counts["encoder"] if getattr(vae, "encoder", None) is not None else 0
        return cls(
            z_dim=cfg.z_dim,
            scale_temporal=cfg.scale_factor_temporal,
            scale_spatial=cfg.scale_factor_spatial,
            patch_size=cfg.patch_size,
            latents_mean=list(cfg.latents_mean),
            latents_std=list(cfg.latents_std),
            num_convs=vae._cached_conv_counts["decoder"],
            encoder_convs=encoder_convs,
        )


class LatentInput:
    """A latent frame as the decoder takes it: on the device, in the compute dtype, and (unless
    the client sent VAE-space latents) denormalized with WanPipeline's constants, built the way
    it builds them (fp32 tensor, 1/std in fp32, then cast) so results match."""

    def __init__(self, facts: ModelFacts, device: torch.device, dtype: torch.dtype) -> None:
        self.device = device
        self.dtype = dtype
        shape = (1, facts.z_dim, 1, 1, 1)
        self.mean = torch.tensor(facts.latents_mean).view(shape).to(device, dtype)
        self.inv_std = (1.0 / torch.tensor(facts.latents_std).view(shape)).to(device, dtype)

    def __call__(self, latent_frame: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        x = latent_frame.to(self.device, non_blocking=True).to(self.dtype)
        if not output.raw_latents:
            x = x / self.inv_std + self.mean
        return x


class LatentOutput:
    """Moments -> normalised latents the way WanImageToVideoPipeline / WanVideoToVideoPipeline
    compute them: the mean cast to the output dtype, then (mean - latents_mean) * latents_std
    with latents_std = 1.0 / std, each constant cast to that dtype first (built per dtype)."""

    def __init__(self, facts: ModelFacts, device: torch.device) -> None:
        self.facts = facts
        self.device = device
        self._consts: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, moments: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        z = self.facts.z_dim
        consts = self._consts.get(dtype)
        if consts is None:
            shape = (1, z, 1, 1, 1)
            mean = torch.tensor(self.facts.latents_mean).view(shape).to(self.device, dtype)
            inv_std = 1.0 / torch.tensor(self.facts.latents_std).view(shape).to(self.device, dtype)
            consts = self._consts[dtype] = (mean, inv_std)
        mean, inv_std = consts
        return (moments[:, :z].to(dtype) - mean) * inv_std


def postprocess(out: torch.Tensor, output: OutputSpec, dtype: torch.dtype) -> torch.Tensor:
    """Clamped decoder output [B, 3, t, H, W] -> wire layout, on the device."""
    if output.rgb8:
        # diffusers' PIL path for an fp32 VAE: (x / 2 + 0.5).clamp(0, 1) * 255, rounded.
        rgb = ((out.float() * 0.5 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
        return rgb.permute(0, 2, 3, 4, 1).contiguous()
    return out.to(output.raw_dtype or dtype).contiguous()


class Engine(ABC):
    """The engine interface. Subclasses set `facts`, `device`, `dtype` and `latent_input`."""

    facts: ModelFacts
    device: torch.device
    dtype: torch.dtype
    latent_input: LatentInput
    graphs: Any = None  # captured decoder calls (vaed.graphs), or None

    # -- model facts ---------------------------------------------------------------------

    @property
    def z_dim(self) -> int:
        return self.facts.z_dim

    @property
    def scale_temporal(self) -> int:
        return self.facts.scale_temporal

    @property
    def scale_spatial(self) -> int:
        return self.facts.scale_spatial

    @property
    def patch_size(self) -> int | None:
        return self.facts.patch_size

    @property
    def latents_mean(self) -> list[float]:
        return self.facts.latents_mean

    @property
    def latents_std(self) -> list[float]:
        return self.facts.latents_std

    @property
    def num_convs(self) -> int:
        return self.facts.num_convs

    @property
    @abstractmethod
    def info(self) -> EngineInfo: ...

    @property
    @abstractmethod
    def identity(self) -> EngineIdentity:
        """What decides this engine's bits (`vaed.identity`), taken once."""

    @property
    def precisions(self) -> tuple[str, ...]:
        return self.info.precisions

    def output_frames(self, latent_frames: int) -> int:
        return wire.output_frames(latent_frames, self.scale_temporal)

    # -- decoding --------------------------------------------------------------------------

    @abstractmethod
    def new_state(self) -> Any: ...

    @abstractmethod
    def decode_frame(self, state: Any, latent_frame: torch.Tensor, output: OutputSpec) -> DecodedGroup:
        """Decode one latent frame [B, z, 1, h, w] (any device) into postprocessed frames on the device."""

    @abstractmethod
    def free(self, state: Any) -> None:
        """Drop a session's caches (may run on the event loop's thread)."""

    def prepare_input(self, latent_frame: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        return self.latent_input(latent_frame, output)

    def finish(self, out: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        """A decoder call's output -> the wire's frames: unpatchify (a latent row -> `patch`
        output rows), clamp to [-1, 1], postprocess."""
        if self.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

            out = unpatchify(out, patch_size=self.patch_size)
        return self.postprocess(torch.clamp(out, min=-1.0, max=1.0), output)

    def postprocess(self, out: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        return postprocess(out, output, self.dtype)

    def decode_video(self, latents: torch.Tensor, output: OutputSpec) -> torch.Tensor:
        """Whole-video decode in this process (warm-up, benchmarks, tests): the served loop, concatenated."""
        state = self.new_state()
        try:
            frames = [latents[:, :, i : i + 1] for i in range(latents.shape[2])]
            groups = [self.decode_frame(state, frame, output).frames for frame in frames]
        finally:
            self.free(state)
        return torch.cat(groups, dim=output.time_dim)

    # -- encoding ----------------------------------------------------------------------------

    @property
    def encodes(self) -> bool:
        """Whether this engine holds an encoder (a decode-only load does not)."""
        return False

    @property
    def encode_dtypes(self) -> tuple[torch.dtype, ...]:
        """The compute dtypes it encodes in, the default first (none without an encoder)."""
        return ()

    def new_encode_state(self) -> EncodeState:
        return EncodeState(cache=[None] * self.facts.encoder_convs)

    def encode_call(self, state: EncodeState, frames: torch.Tensor, spec: EncodeSpec) -> EncodedGroup:
        """One encoder call on frames [B, 3, t, H, W] in [-1, 1] (t = 1 first, then
        `scale_temporal`), advancing `state.cache`: one latent frame."""
        raise NotImplementedError(f"{type(self).__name__} does not encode")

    def encode_frames(self, state: EncodeState, frames: torch.Tensor, spec: EncodeSpec) -> list[EncodedGroup]:
        """Feed frames [B, 3, t, H, W] (any t >= 0, any device); returns the latent frames whose
        encoder calls are now full (none while the first call's frame or four later ones are
        still incomplete)."""
        if frames.shape[2]:
            state.pending.append(frames)
            state.pending_frames += frames.shape[2]
            state.frames_in += frames.shape[2]
        groups = []
        while state.pending_frames >= (need := 1 if state.next_latent_frame == 0 else self.scale_temporal):
            groups.append(self.encode_call(state, _take_frames(state, need), spec))
            state.next_latent_frame += 1
        return groups

    def free_encode(self, state: EncodeState) -> None:
        """Drop an encode's cache and waiting frames (may run on the event loop's thread)."""
        state.cache = None
        state.pending.clear()
        state.pending_frames = 0

    def end_encode(self, state: EncodeState) -> None:
        """The input ended: ValueError when it was not 1 + 4k frames (some are still waiting)."""
        wire.encoded_latent_frames(state.frames_in, self.scale_temporal)

    def encode_video(self, frames: torch.Tensor, spec: EncodeSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Whole-video encode in this process: (moments, latents or None), the served loop concatenated."""
        wire.encoded_latent_frames(frames.shape[2], self.scale_temporal)
        state = self.new_encode_state()
        try:
            groups = self.encode_frames(state, frames, spec)
            self.end_encode(state)
        finally:
            self.free_encode(state)
        moments = torch.cat([g.moments for g in groups], dim=2)
        latents = torch.cat([g.latents for g in groups], dim=2) if spec.latents else None  # type: ignore[misc]  # each group has them when spec.latents asks
        return moments, latents

    # -- the group around the engine (a one-device engine has none) ------------------------------

    @property
    def healthy(self) -> bool:
        return True

    def describe(self) -> str:
        """ModelInfo.parallel: "off" for one device (a sharded engine names its group)."""
        return Parallel.OFF

    def health_entries(self) -> dict[str, bool]:
        """Extra health-service entries (name suffix -> serving) beside the device's own."""
        return {}

    def prepare_conv_plans(self, latent_hws: list[tuple[int, int]]) -> None:  # noqa: B027  (optional hook)
        """Before the warm-up decodes: time the fast tier's convs at these sizes on cuDNN's
        engines where asked (`--conv-plans tune`); nothing for an engine without a planner."""

    def keepalive(self) -> None:  # noqa: B027  (an optional hook: a one-device engine has nothing to do)
        """Called by the device worker on every pass of its loop, idle or not: an engine that
        must show its group it is alive does so when due (cheap otherwise)."""

    def close(self) -> None:  # noqa: B027  (an optional hook: a one-device engine holds only its weights)
        """Release what the engine holds beyond its weights (a sharded engine stops its group)."""


def _take_frames(state: EncodeState, n: int) -> torch.Tensor:
    """The first `n` waiting frames, as one tensor (pieces are split where a call ends)."""
    parts, got = [], 0
    while got < n:
        piece = state.pending[0]
        take = min(n - got, piece.shape[2])
        parts.append(piece[:, :, :take])
        if take == piece.shape[2]:
            state.pending.pop(0)
        else:
            state.pending[0] = piece[:, :, take:]
        got += take
    state.pending_frames -= n
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


EngineFactory = Callable[[str], Engine]  # device -> engine
