"""The decode engine: a plain decoder object, no server and no gRPC.

Built from a loaded model and (device, dtype, op set, layout); `vaed bench`,
the device worker and the tests all use the same constructor. Its methods run
on whichever thread owns the device (the worker's, in the server).

Bit-exactness: the loop is diffusers' `AutoencoderKLWan._decode` taken apart
per latent frame. Each decoder call sees the inputs it sees in diffusers (one
latent frame after post_quant_conv, the same cache list, `first_chunk` on
frame 0), so each call's output has the same bytes; the cache list belongs to
the caller's `DecodeState` instead of the module's shared `_feat_map`.

post_quant_conv runs here on one latent frame at a time, whatever the
chunking of the input, so a DecodeStream session equals a one-shot Decode of
the concatenated latents by construction. diffusers runs it on all T frames at
once. It is a 1x1x1 conv, so the two agree as long as the conv's per-pixel
arithmetic does not depend on T: an assumption, not a guarantee (cuDNN may pick
another algorithm for another T). The tests check equality with diffusers at
the sizes they decode (CPU fp32; real sizes on the H200). Decoding frame by
frame also lets the first frame leave before the rest of the request is
prepared.

Encoding (`encode_call`, fed by `Engine.encode_frames`) is
`AutoencoderKLWan._encode` taken apart the same way: one encoder call per
latent frame (frame 0, then four frames), the session's cache list, and
quant_conv per call, so each latent frame can leave as soon as its call ran,
where diffusers runs quant_conv once on the concatenated output. The same
assumption as post_quant_conv's above, with a known exception: on the CPU a
one-frame 1x1x1 conv of a tiny latent (B=1, 2x3 latent pixels: Wan2.2 at
32x48) takes another aten kernel than the whole video's and differs by one
ulp; at 4x6 and up (and the real sizes checked, 30x52 and 45x80) the CPU
agrees. The tests compare with diffusers' encode at the sizes they use; the
GPU tests at real sizes. The encoder's weights are loaded only when asked
(`load(..., encoder=True)`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any

import torch

from . import patches
from .choices import ComputeDtype, ConvPlans, CudaGraphs, Kernels, Layout, Precision
from .engine_protocol import (
    DecodedGroup,
    EncodedGroup,
    EncodeSpec,
    EncodeState,
    Engine,
    EngineInfo,
    LatentInput,
    LatentOutput,
    ModelFacts,
    OutputSpec,
)
from .graphs import DEFAULT_MAX_GRAPHS, DecoderGraphs
from .identity import EngineIdentity, device_kind
from .models import LoadedModel, load_model, weights_digest
from .patches import conv_plans
from .startup import phase

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    ComputeDtype.FLOAT32: torch.float32,
    ComputeDtype.FLOAT16: torch.float16,
    ComputeDtype.BFLOAT16: torch.bfloat16,
}


# Latent frames that reach the steady chunk: frame 0 has no cache, frame 1 a
# one-frame cache, frames >= 2 the steady two-frame cache; the fourth runs the
# steady chunk once more so its cuDNN plans, Triton specialisations and
# allocator blocks exist before the first timed or served decode.
WARMUP_LATENT_FRAMES = 4


@dataclass
class DecodeState:
    """One video's causal cache and position (owned by its session)."""

    cache: list[Any] | None                 # diffusers feat_cache list
    next_latent_frame: int = 0              # index of the next decoder call
    next_output_frame: int = 0              # first frame index of the next group


class DecodeEngine(Engine):
    def __init__(
        self,
        loaded: LoadedModel,
        *,
        kernels: str = Kernels.AUTO,
        layout: str = Layout.AUTO,
        disabled_ops: tuple[str, ...] = (),
        cuda_graphs: str = CudaGraphs.OFF,
        encode_dtype: torch.dtype | None = None,
        max_graphs: int = DEFAULT_MAX_GRAPHS,
        conv_plans: str = ConvPlans.OFF,
        conv_plan_file: str | None = None,
    ) -> None:
        self.loaded = loaded
        self.vae = loaded.vae
        param = next(self.vae.decoder.parameters())
        self.device: torch.device = param.device
        self.dtype: torch.dtype = param.dtype
        self.facts = ModelFacts.of(self.vae)
        self.latent_input = LatentInput(self.facts, self.device, self.dtype)
        self.latent_output = LatentOutput(self.facts, self.device)
        # Both tiers are prepared on the one copy of the weights; each decoder call
        # picks its session's op set (`patches.using`). Off CUDA only lossless is usable.
        # A start-up phase: the layout, the forwards and every fused op's bit-identity check
        # (the first Triton compiles).
        with phase("fast paths"):
            self.fast_paths = patches.prepare_decoder(
                self.vae, kernels=kernels, layout=layout, disabled_ops=frozenset(disabled_ops),
                tiers=tuple(Precision),
            )
            # Encode dtypes: the weights' own, and one encoder-only copy per other dtype loaded
            # (LoadedModel.encoder_copies), each prepared like the decoder; the default first.
            self.encoders: dict[torch.dtype, tuple[Any, patches.FastPathReport]] = {}
            if self.vae.encoder is not None:
                self.encoders[self.dtype] = (self.vae, self.fast_paths)
                for dt, copy in loaded.encoder_copies.items():
                    self.encoders[dt] = (copy, patches.prepare_decoder(
                        copy, kernels=kernels, layout=layout, disabled_ops=frozenset(disabled_ops),
                        tiers=(Precision.LOSSLESS,)))
        default = encode_dtype if encode_dtype in self.encoders else self.dtype
        self._encode_dtypes = tuple(sorted(self.encoders, key=lambda d: d != default))
        # Captured decoder calls (vaed.graphs): CUDA only; the sharded path never uses them.
        self.graphs: DecoderGraphs | None = None
        graph_mode = CudaGraphs.parse(cuda_graphs, "cuda_graphs")
        if graph_mode != CudaGraphs.OFF and self.device.type == "cuda":
            self.graphs = DecoderGraphs(self.device, max_graphs=max_graphs,
                                        first_chunk_only=graph_mode == CudaGraphs.FIRST)
        elif graph_mode != CudaGraphs.OFF:  # said, as an unused --precision fast is
            log.warning("--cuda-graphs %s: CUDA graphs need a CUDA device; %s decodes without them",
                        graph_mode, self.device)
        self.conv_plans = ConvPlans.parse(conv_plans, "conv_plans")
        # one planner per tier on this device: the fast tier's within a tolerance, the lossless
        # tier's with torch's bits (vaed.patches.conv_plans)
        self.conv_planners = self._open_conv_planners(conv_plan_file)
        log.info("decoder ready on %s: %s%s%s", self.device, self.fast_paths.summary,
                 f", CUDA graphs {graph_mode}" if self.graphs is not None else "",
                 f", conv plans {self.conv_plans} ("
                 + ", ".join(f"{p}: {len(pl.choices)} in the file" for p, pl in self.conv_planners.items()) + ")"
                 if self.conv_planners else "")

    def _open_conv_planners(self, plan_file: str | None) -> dict[Precision, conv_plans.ConvPlanner]:
        """Each prepared tier's conv planner on this device (`vaed.patches.conv_plans`; the
        lossless tier's takes only plans with torch's bits), installed; none when off, off
        CUDA, or where the frontend cannot run (logged)."""
        if self.conv_plans == ConvPlans.OFF or self.device.type != "cuda":
            return {}
        shared = conv_plans.PlanFile(plan_file) if plan_file is not None else None  # one file, a section per rule
        planners: dict[Precision, conv_plans.ConvPlanner] = {}
        for precision in self.fast_paths.op_sets:
            p = Precision(precision)
            planner = conv_plans.ConvPlanner.open(self.device, shared, exact=p == Precision.LOSSLESS)
            if isinstance(planner, str):
                log.warning("conv plans off on %s: %s", self.device, planner)
                return {}
            planners[p] = planner
        for planner in planners.values():  # all or none
            conv_plans.install(planner)
        return planners

    def close(self) -> None:
        """Take this engine's conv planners off its device (the registry holds one per device and rule)."""
        for planner in self.conv_planners.values():
            if conv_plans.planner_for(self.device, planner.exact) is planner:
                conv_plans.uninstall(self.device, planner.exact)
        self.conv_planners = {}

    def prepare_conv_plans(self, latent_hws: list[tuple[int, int]],
                           precisions: tuple[Precision, ...] | None = None) -> None:
        """`--conv-plans tune`: decode each size once in each planned tier (of ``precisions``, default
        all) to see its convs, time those the plan file lacks, and write what won to the file. The
        pass runs eagerly: CUDA graphs are captured by the warm-up after it, with the plans."""
        planners = {p: pl for p, pl in self.conv_planners.items() if precisions is None or p in precisions}
        if self.conv_plans != ConvPlans.TUNE or not planners:
            return
        with phase("conv plans"):
            graphs, self.graphs = self.graphs, None
            try:
                for precision in planners:
                    for hw in latent_hws:
                        warm_up(self, hw, precision)
            finally:
                self.graphs = graphs
            for precision, planner in planners.items():
                self._tune_conv_plans(precision, planner)

    def _tune_conv_plans(self, precision: Precision, planner: conv_plans.ConvPlanner) -> None:
        where = f"{self.device}, {precision}"
        todo = len(planner.unplanned)
        if not todo:
            log.info("conv plans on %s: every conv of the warm-up sizes is in the file", where)
            return
        rule = "with torch's bits" if planner.exact else "within tolerance"
        log.info("conv plans on %s: timing %d conv shapes on cuDNN's engines (plans %s)", where, todo, rule)

        def progress(done: int, total: int, call: conv_plans.ConvCall, choice: conv_plans.PlanChoice) -> None:
            verdict = f"{choice.name} {choice.gain:.2f}x" if choice.engine_id is not None else "torch's pick"
            log.info("conv plans on %s: %d/%d %s: torch %.3f ms -> %s", where, done, total,
                     call.label(), choice.torch_ms, verdict)

        report = planner.tune(progress=progress)
        log.info("conv plans on %s: %d of %d shapes on another engine, their convs %.2f -> %.2f ms "
                 "(one launch each), %.1f s", where, report.planned, report.calls, report.torch_ms,
                 report.chosen_ms, report.seconds)
        if report.left:
            log.warning("conv plans on %s: %d shapes left untimed after %.0f s (torch's pick runs them; "
                        "the next start with --conv-plans tune times them)", where, report.left,
                        report.seconds)
        for failure in report.failed:
            log.warning("conv plans on %s: the frontend refused %s", where, failure)

    @classmethod
    def load(
        cls, model: str, *, device: str, dtype: str | torch.dtype, encoder: bool = False,
        encode_dtype: str | torch.dtype | None = None, **options: Any
    ) -> DecodeEngine:
        """Load `model` (a `--model` spec) onto `device` and build the engine; decoder-only
        unless `encoder` (the encoder's weights: 0.1 GiB bf16 for Wan2.1). `encode_dtype`, when
        it differs from `dtype`, adds an encoder copy in it and makes it the encode's default."""
        torch_dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
        enc_dtype = DTYPES[encode_dtype] if isinstance(encode_dtype, str) else encode_dtype
        extra = (enc_dtype,) if encoder and enc_dtype is not None else ()
        with phase("model load"):
            loaded = load_model(model, device, torch_dtype, decoder_only=not encoder, encoder_dtypes=extra)
        return cls(loaded, encode_dtype=enc_dtype, **options)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.loaded.spec,
            random_weights=self.loaded.random_weights,
            device=str(self.device),
            dtype=self.dtype,
            kernels=self.fast_paths.kernels,
            layout=self.fast_paths.layout,
            fast_paths_note=self.fast_paths.stock_reason or "",
            precisions=self.precisions,
        )

    @functools.cached_property
    def identity(self) -> EngineIdentity:
        """What decides this engine's bits. The weights' digests come from `load_model`, taken on
        the CPU copy before the cast; a model loaded elsewhere (a benchmark's) is digested here,
        as it is now, on first use only."""
        digests = self.loaded.digests

        def digest(half: str) -> str:
            made = digests.get(half)
            return made.result() if made is not None else weights_digest(self.vae, half)

        identity = EngineIdentity(
            weights=digest("decoder"), dtype=self.dtype,
            kernels=self.fast_paths.kernels, layout=self.fast_paths.layout, device=device_kind(self.device),
            disabled_ops=tuple(self.fast_paths.disabled_ops),
        )
        if not self.encodes:
            return identity
        dtype = self._encode_dtypes[0]
        paths = self.encoders[dtype][1]
        return dataclasses.replace(
            identity, encoder_weights=digest("encoder"),
            encode_dtype=dtype, encoder_kernels=paths.kernels, encoder_layout=paths.layout)

    @property
    def precisions(self) -> tuple[str, ...]:
        """Tiers this engine decodes: lossless always (the stock chain is lossless), fast when its ops passed."""
        return (Precision.LOSSLESS,) + ((Precision.FAST,) if Precision.FAST in self.fast_paths.op_sets else ())

    # -- decoding ----------------------------------------------------------------

    def new_state(self) -> DecodeState:
        return DecodeState(cache=[None] * self.num_convs)

    @torch.inference_mode()
    def decode_frame(self, state: DecodeState, latent_frame: torch.Tensor, output: OutputSpec) -> DecodedGroup:
        """Decode one latent frame [B, z, 1, h, w] (any device) into postprocessed frames on the device."""
        x = patches.to_decoder_layout(self.prepare_input(latent_frame, output), self.fast_paths.layout)
        index = state.next_latent_frame
        first_chunk = index == 0
        ops = self.fast_paths.op_sets.get(output.precision)

        def call(x: torch.Tensor, cache: list[Any]) -> torch.Tensor:
            z = self.vae.post_quant_conv(x)
            return self.vae.decoder(z, feat_cache=cache, feat_idx=[0], first_chunk=first_chunk)

        with patches.using(ops) if ops is not None else contextlib.nullcontext():
            if self.graphs is not None:
                # a replay's output lives in the graph: unpatchify/clamp below copy it before the next call
                out = self.graphs.run(state, output.precision, first_chunk, x, call)
            else:
                out = call(x, state.cache)  # type: ignore[arg-type]  # None only once free()d; no call follows
        frames = self.finish(out, output)  # copies a replay's output out of the graph
        group = DecodedGroup(chunk_index=index, first_frame=state.next_output_frame, frames=frames)
        state.next_latent_frame += 1
        state.next_output_frame += frames.shape[output.time_dim]
        return group

    # -- encoding ----------------------------------------------------------------------------

    @property
    def encodes(self) -> bool:
        return self.vae.encoder is not None

    @property
    def encode_dtypes(self) -> tuple[torch.dtype, ...]:
        return self._encode_dtypes

    @torch.inference_mode()
    def encode_call(self, state: EncodeState, frames: torch.Tensor, spec: EncodeSpec) -> EncodedGroup:
        """One `AutoencoderKLWan._encode` loop step: the frames in the weights' layout (then
        patchified for Wan2.2, as diffusers patchifies the whole input), the encoder with the
        session's cache, quant_conv on its one latent frame."""
        if not self.encodes:
            raise NotImplementedError("this engine was loaded decoder-only")
        dtype = spec.dtype or self._encode_dtypes[0]
        vae, paths = self.encoders[dtype]
        x = patches.to_decoder_layout(frames.to(self.device, non_blocking=True).to(dtype), paths.layout)
        if self.patch_size is not None:
            from diffusers.models.autoencoders.autoencoder_kl_wan import patchify

            x = patchify(x, patch_size=self.patch_size)
        ops = paths.op_sets.get(spec.precision)
        with patches.using(ops) if ops is not None else contextlib.nullcontext():
            moments = vae.quant_conv(vae.encoder(x, feat_cache=state.cache, feat_idx=[0]))
        out_dtype = spec.out_dtype or dtype
        latents = self.latent_output(moments, out_dtype) if spec.latents else None
        return EncodedGroup(state.next_latent_frame, moments.to(out_dtype), latents)

    def free(self, state: DecodeState) -> None:
        # may run on the event loop's thread (a detach): graphs notice a freed owner themselves
        state.cache = None


# Frames that reach the encoder's steady call: frame 0 alone (no cache), a 4-frame call on frame
# 0's cache, then one on the steady two-frame cache (Wan2.1 / Wan2.2: 4 frames per call).
WARMUP_ENCODE_FRAMES = 9


def warm_up_encode(engine: Engine, latent_hw: tuple[int, int], dtype: torch.dtype,
                   frames: int = WARMUP_ENCODE_FRAMES) -> None:
    """Encode zero frames of one size (latent_hw times the spatial factor) through the served
    encode loop in one encode dtype: the encoder's Triton compiles, cuDNN plans and allocator
    blocks, as `warm_up` does for the decoder."""
    s = engine.scale_spatial
    engine.encode_video(torch.zeros(1, 3, frames, latent_hw[0] * s, latent_hw[1] * s), EncodeSpec(dtype=dtype))


def warm_up(engine: Engine, latent_hw: tuple[int, int], precision: str, frames: int = WARMUP_LATENT_FRAMES) -> None:
    """Decode zeros at one size up to the steady chunk (Triton compiles, cuDNN plans, allocator
    blocks) through `engine.decode_video` (a sharded engine warms its group too). With CUDA graphs
    a second video captures the first chunks' signatures: the first runs each signature eagerly
    once and captures only the steady one."""
    latents = torch.zeros(1, engine.z_dim, frames, *latent_hw)
    spec = OutputSpec(rgb8=True, raw_dtype=None, raw_latents=True, precision=precision)
    for _ in range(2 if getattr(engine, "graphs", None) is not None else 1):
        engine.decode_video(latents, spec)
