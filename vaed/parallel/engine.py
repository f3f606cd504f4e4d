"""`ShardedEngine`: one video decoded by every rank of a torch.distributed group.

Shape of the design (one process per GPU):

- rank 0 lives in the server process, wraps that GPU's ordinary
  `DecodeEngine` (same weights, same fast paths) and offers the engine's
  per-session interface: `new_state()`, `decode_frame(state, latent_frame,
  output) -> DecodedGroup` (frames on rank 0's device), `free(state)`,
  `decode_video(...)`. The server's device worker calls it exactly like a
  one-GPU engine, so frames still stream per latent chunk and DecodeStream
  sessions work sharded.
- ranks 1.. are follower processes (see launch.py) that hold their own
  `DecodeEngine` and run `Follower.run()`: a loop that receives a small step
  descriptor from rank 0 (op, session id, latent shape, frame index, output
  spec, axis), then the latent frame itself, and decodes their shard.
- Descriptors go over a gloo "control" group on the CPU with a long timeout
  (followers wait there while the server is idle; an NCCL collective waiting
  that long would trip the NCCL watchdog). Latents, halos, the attention
  gather and the frames go over the data group (NCCL between GPUs, gloo on CPU).
- The plan (axis, shard sizes) is decided by rank 0 on a session's first
  latent frame. A latent too small for the group (see plan.py) is decoded on
  rank 0 alone by the wrapped engine -- followers never hear of it, and its
  output is bit-identical to the one-GPU engine's.
- A session's state on every rank is its own cache list (per rank, the
  shard's own frames), so sessions interleave per latent frame like one-GPU sessions.

Failure model: a rank that dies or raises mid-step leaves the others blocked
in a collective until the data group's timeout; the engine then marks itself
broken (`healthy` False) and raises `ShardGroupError` for every later call.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ShardGroupError
from ..patches.ops import OpSet
from .comm import gather_along, group_rank_world
from .forward import ShardContext, check_shardable, decoder_forward
from .inner_ops import resolve_inner_ops
from .plan import AXIS_CHOICES, ShardPlan, plan_shards, split_sizes

log = logging.getLogger(__name__)

# step descriptor: int64[HEADER_LEN] broadcast on the control group
HEADER_LEN = 12
OP_STOP, OP_FRAME, OP_FREE, OP_NOOP, OP_STATS = 0, 1, 2, 3, 4
# fields: op, sid, B, z, h, w, index, rgb8, raw dtype, axis, precision, reserved
_RAW_DTYPES: list[torch.dtype | None] = [None, torch.float32, torch.float16, torch.bfloat16]
_AXES = ("height", "width")
_PRECISIONS = ("lossless", "fast")


@dataclass(frozen=True)
class _Output:
    """The fields of an output spec a follower needs (duck-types vaed.session.OutputSpec)."""

    rgb8: bool
    raw_dtype: torch.dtype | None
    raw_latents: bool
    precision: str = "lossless"


@dataclass
class ShardedState:
    """One video on the group: `local` for a one-GPU session, else this rank's sharded cache."""

    sid: int
    plan: ShardPlan | None = None
    local: Any = None  # the wrapped engine's DecodeState, for sessions too small to shard
    cache: list[Any] | None = None
    shape: tuple[int, int, int] | None = None  # (B, h, w) of the first frame
    next_latent_frame: int = 0
    next_output_frame: int = 0


def _inner_ops(base: Any, kernels: str, precision: str) -> OpSet:
    """The op bundle of a precision tier: the one the wrapped engine prepared for it (its
    start-up checks and per-op switches included), else the lossless set, else plain torch."""
    report = getattr(base, "fast_paths", None)
    if kernels != "off" and hasattr(report, "ops_for"):
        try:
            return report.ops_for(precision)  # type: ignore[no-any-return, union-attr]
        except KeyError:  # tier not prepared (e.g. kernels off on this device)
            pass
    return resolve_inner_ops(kernels)


class _ShardRunner:
    """What every rank does for one sharded latent frame (rank 0 and followers alike)."""

    def __init__(self, base: Any, data_group: dist.ProcessGroup | None, kernels: str) -> None:
        check_shardable(base.vae.decoder)
        self.base = base
        self.group = data_group
        self.rank, self.world = group_rank_world(data_group)
        self.kernels = kernels
        self._ops: dict[str, OpSet] = {}
        self.layout: str = base.fast_paths.layout

    def ops(self, precision: str) -> OpSet:
        if precision not in self._ops:
            self._ops[precision] = _inner_ops(self.base, self.kernels, precision)
        return self._ops[precision]

    def to_layout(self, x: torch.Tensor) -> torch.Tensor:
        if self.layout == "channels_last":
            return x.contiguous(memory_format=torch.channels_last_3d)
        return x.contiguous()

    @torch.inference_mode()
    def step(self, state: ShardedState, x: torch.Tensor, output: Any) -> torch.Tensor | None:
        """x: the whole (denormalized, compute-dtype) latent frame [B, z, 1, h, w] on this rank's
        device. Returns the gathered postprocessed frames on rank 0, None elsewhere."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        plan = state.plan
        assert plan is not None and state.cache is not None
        vae = self.base.vae
        shard = x.narrow(plan.dim, plan.offsets[self.rank], plan.sizes[self.rank])
        shard = vae.post_quant_conv(self.to_layout(shard))  # 1x1x1: local
        ctx = ShardContext(self.group, self.rank, plan, self.ops(getattr(output, "precision", "lossless")))
        out = decoder_forward(ctx, vae.decoder, shard, state.cache, first_chunk=state.next_latent_frame == 0)
        patch = self.base.patch_size
        if patch is not None:
            out = unpatchify(out, patch_size=patch)  # local: a latent row -> `patch` output rows
        out = torch.clamp(out, min=-1.0, max=1.0)
        frames = self.base.postprocess(out, output)
        state.next_latent_frame += 1
        # RGB8 is [B, t, H, W, 3]; RAW is [B, 3, t, H, W]
        dim = plan.dim - 1 if output.rgb8 else plan.dim
        sizes = plan.scaled(frames.shape[dim] // plan.sizes[self.rank])
        return gather_along(frames, dim, sizes, self.group)


class ShardedEngine:
    """Rank 0's engine over a group: the one-GPU engine interface, decoded by all ranks.

    `base` is rank 0's `DecodeEngine` (vaed.engine); `data_group` carries tensors
    (None = the default group), `control_group` the step descriptors (gloo).
    `axis` is "auto" | "height" | "width"; `min_pixels` the output frame size below
    which a session stays on one GPU (0: shard whenever the latent is large enough).
    """

    def __init__(
        self,
        base: Any,
        *,
        data_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        axis: str = "auto",
        min_pixels: int = 0,
        kernels: str = "auto",
        launched: Any = None,
    ) -> None:
        if axis not in AXIS_CHOICES:
            raise ValueError(f"axis must be one of {AXIS_CHOICES}, got {axis!r}")
        rank, world = group_rank_world(data_group)
        if rank != 0:
            raise ValueError(f"ShardedEngine runs on the group's rank 0; this is rank {rank} (run Follower)")
        self.base = base
        self.axis = axis
        self.min_pixels = min_pixels
        self.world = world
        self.control = control_group
        self.runner = _ShardRunner(base, data_group, kernels)
        self.healthy = True
        self._broken = False
        self._launched = launched  # a launch.ShardGroup whose processes this engine stops
        self._sids = itertools.count(1)
        self.sharded_frames = 0  # latent frames decoded by the whole group (metrics, tests)
        self.local_frames = 0  # latent frames decoded on rank 0 alone (too small, or group broken)
        self._comm_device = torch.device("cpu") if dist.get_backend(data_group) == "gloo" else base.device

    def __getattr__(self, name: str) -> Any:
        # everything else a server reads from an engine (z_dim, scale factors, latents
        # statistics, info, fast_paths, loaded...) is rank 0's one-GPU engine's
        if name == "base":  # not set yet (construction failed): no recursion
            raise AttributeError(name)
        return getattr(self.base, name)

    def describe(self) -> str:
        """For ModelInfo / logs: "spatial x2 (axis auto, shard from 0 px)"."""
        return f"spatial x{self.world} (axis {self.axis}, shard from {self.min_pixels} px)"

    # -- the engine interface -------------------------------------------------------------

    @property
    def vae(self) -> Any:
        return self.base.vae

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def dtype(self) -> torch.dtype:
        return self.base.dtype

    def output_frames(self, latent_frames: int) -> int:
        return self.base.output_frames(latent_frames)  # type: ignore[no-any-return]

    def postprocess(self, out: torch.Tensor, output: Any) -> torch.Tensor:
        return self.base.postprocess(out, output)  # type: ignore[no-any-return]

    def plan_for(self, h: int, w: int) -> ShardPlan | None:
        """The plan a latent of h x w gets on this group (None: one GPU)."""
        return plan_shards(
            h, w, self.world, self.axis, scale_spatial=self.base.scale_spatial, min_pixels=self.min_pixels
        )

    def new_state(self) -> ShardedState:
        return ShardedState(sid=next(self._sids))

    def decode_frame(self, state: ShardedState, latent_frame: torch.Tensor, output: Any) -> Any:
        """Decode one latent frame [B, z, 1, h, w]; returns the engine's DecodedGroup on rank 0.

        Callable from any thread (the server's device worker): NCCL takes the
        current CUDA device of the calling thread, so it is set here.
        """
        with _device_scope(self.base.device):
            return self._decode_frame(state, latent_frame, output)

    @torch.inference_mode()
    def _decode_frame(self, state: ShardedState, latent_frame: torch.Tensor, output: Any) -> Any:
        from vaed.engine import DecodedGroup

        b, z, t, h, w = latent_frame.shape
        if t != 1:
            raise ValueError(f"decode_frame takes one latent frame, got T={t}")
        if state.shape is None:
            state.shape = (b, h, w)
            # a broken group degrades to one GPU for new sessions: rank 0 keeps serving
            state.plan = self.plan_for(h, w) if self.healthy else None
            if state.plan is None:
                state.local = self.base.new_state()
                log.debug("session %d: %dx%d latent decodes on one GPU", state.sid, h, w)
            else:
                state.cache = [None] * self.base.num_convs
                log.debug("session %d: %dx%d latent sharded %s %s", state.sid, h, w, state.plan.axis, state.plan.sizes)
        elif state.shape != (b, h, w):
            raise ValueError(f"frame has B, h, w = {(b, h, w)} but the session started with {state.shape}")
        if state.local is not None:
            group = self.base.decode_frame(state.local, latent_frame, output)
            self.local_frames += 1
            state.next_latent_frame = state.local.next_latent_frame
            state.next_output_frame = state.local.next_output_frame
            return group
        if state.cache is None:
            raise ValueError(f"session {state.sid} was freed")  # refused before the group hears of it
        self._check_healthy()
        plan = state.plan
        assert plan is not None
        x = latent_frame.to(self.base.device, non_blocking=True).to(self.base.dtype)
        if not output.raw_latents:  # the wrapped engine's constants: the same bytes as one GPU
            x = x / self.base._inv_std + self.base._mean
        index = state.next_latent_frame
        header = [
            OP_FRAME, state.sid, b, z, h, w, index, int(output.rgb8), _code(_RAW_DTYPES, output.raw_dtype, "raw dtype"),
            _AXES.index(plan.axis), _code(_PRECISIONS, getattr(output, "precision", "lossless"), "precision"), 0,
        ]  # fmt: skip
        try:
            self._send_header(header)
            x = self._broadcast_latent(x.contiguous())
            frames = self.runner.step(state, x, output)
        except Exception as exc:
            self._fail(exc)
            raise ShardGroupError(f"sharded decode failed on the group: {exc}") from exc
        assert frames is not None
        self.sharded_frames += 1
        group = DecodedGroup(chunk_index=index, first_frame=state.next_output_frame, frames=frames)
        state.next_output_frame += frames.shape[1 if output.rgb8 else 2]  # RGB8 [B, t, ...], RAW [B, 3, t, ...]
        return group

    def free(self, state: ShardedState) -> None:
        """Drop the session's caches on every rank (a no-op for followers if it never went sharded)."""
        if state.local is not None:
            self.base.free(state.local)
            state.local = None
        if state.cache is not None:
            state.cache = None
            if self.healthy:
                try:
                    self._send_header([OP_FREE, state.sid] + [0] * (HEADER_LEN - 2))
                except Exception as exc:  # noqa: BLE001 (the group is gone; the state is freed anyway)
                    self._fail(exc)

    def decode_video(self, latents: torch.Tensor, output: Any) -> torch.Tensor:
        """Whole-video decode through the per-frame loop (warm-up, benchmarks, tests)."""
        state = self.new_state()
        try:
            groups = [self.decode_frame(state, latents[:, :, i : i + 1], output).frames for i in range(latents.shape[2])]
        finally:
            self.free(state)
        return torch.cat(groups, dim=1 if output.rgb8 else 2)

    def peak_memory(self, reset: bool = False) -> list[int]:
        """Peak allocated bytes on each rank's device (rank order; 0 on CPU); `reset` starts a new window."""
        self._check_healthy()
        self._send_header([OP_STATS, int(reset)] + [0] * (HEADER_LEN - 2))
        return _exchange_peak(self.base.device, self.control, reset)

    def keepalive(self) -> None:
        """A no-op step: call while idle more often than the control group's timeout (launch.py)."""
        self._check_healthy()
        self._send_header([OP_NOOP] + [0] * (HEADER_LEN - 1))

    def close(self) -> None:
        """Stop the followers (and the processes launch.py started); idempotent."""
        if self.healthy:
            try:
                self._send_header([OP_STOP] + [0] * (HEADER_LEN - 1))
            except Exception as exc:  # noqa: BLE001 (already broken: nothing to tell)
                log.warning("could not stop the followers cleanly: %s", exc)
            self.healthy = False
        if self._launched is not None:
            # followers of a broken group may sit in a collective forever: do not wait for them
            self._launched.join(timeout=60.0 if not self._broken else 0.0)
            self._launched = None

    # -- internals ------------------------------------------------------------------------

    def _check_healthy(self) -> None:
        if not self.healthy:
            raise ShardGroupError("the sharded group is stopped or broken")

    def _fail(self, exc: BaseException) -> None:
        log.error("sharded group broken: %s", exc)
        self.healthy = False
        self._broken = True

    def _send_header(self, header: list[int]) -> None:
        # A follower that died is not always noticed by the collective: a gloo broadcast to a
        # killed rank hung on the (24-day) control timeout in a loaded CPU test run. The
        # processes this engine launched are checked first (a waitpid each).
        exited = self._launched.exited() if self._launched is not None else []
        if exited:
            raise ShardGroupError(", ".join(f"follower pid {pid} exited with code {code}" for pid, code in exited))
        t = torch.tensor(header, dtype=torch.int64)
        dist.broadcast(t, src=_global0(self.control), group=self.control)

    def _broadcast_latent(self, x: torch.Tensor) -> torch.Tensor:
        buf = x.to(self._comm_device)
        dist.broadcast(buf, src=_global0(self.runner.group), group=self.runner.group)
        return x


def _code(table: Any, value: Any, what: str) -> int:
    """A descriptor field's code; refused before anything is sent, so the group stays in step."""
    if value not in table:
        raise ValueError(f"{what} {value!r} cannot be decoded sharded; known: {list(table)}")
    return int(table.index(value))


def _device_scope(device: torch.device) -> Any:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _global0(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def _exchange_peak(device: torch.device, control: dist.ProcessGroup | None, reset: bool) -> list[int]:
    """Every rank's peak allocated device bytes since the last reset (0 on CPU), on every rank."""
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    if reset and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    mine = torch.tensor([peak], dtype=torch.int64)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(control))]
    dist.all_gather(out, mine, group=control)
    return [int(t.item()) for t in out]


class Follower:
    """Ranks 1..: decode their shard of every step rank 0 announces, until OP_STOP."""

    def __init__(
        self,
        base: Any,
        *,
        data_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        kernels: str = "auto",
    ) -> None:
        self.runner = _ShardRunner(base, data_group, kernels)
        if self.runner.rank == 0:
            raise ValueError("rank 0 drives the group (ShardedEngine); followers are ranks 1..")
        self.base = base
        self.control = control_group
        self.states: dict[int, ShardedState] = {}
        self._comm_device = torch.device("cpu") if dist.get_backend(data_group) == "gloo" else base.device

    def run(self) -> None:
        while True:
            header = torch.empty(HEADER_LEN, dtype=torch.int64)
            dist.broadcast(header, src=_global0(self.control), group=self.control)
            op, sid, b, z, h, w, index, rgb8, raw, axis, precision, _ = header.tolist()
            if op == OP_STOP:
                log.info("rank %d: stop", self.runner.rank)
                return
            if op == OP_NOOP:
                continue
            if op == OP_FREE:
                self.states.pop(sid, None)
                continue
            if op == OP_STATS:
                _exchange_peak(self.base.device, self.control, reset=bool(sid))
                continue
            if op != OP_FRAME:
                raise ShardGroupError(f"unknown step op {op}")
            state = self.states.get(sid)
            if state is None:
                if index != 0:
                    raise ShardGroupError(f"session {sid} starts at latent frame {index}, expected 0")
                extent = h if _AXES[axis] == "height" else w
                plan = ShardPlan(_AXES[axis], split_sizes(extent, self.runner.world))  # type: ignore[arg-type]
                state = ShardedState(sid=sid, plan=plan, cache=[None] * self.base.num_convs, shape=(b, h, w))
                self.states[sid] = state
            if state.next_latent_frame != index:
                raise ShardGroupError(f"session {sid}: rank 0 sent frame {index}, this rank is at {state.next_latent_frame}")
            x = torch.empty((b, z, 1, h, w), dtype=self.base.dtype, device=self._comm_device)
            dist.broadcast(x, src=_global0(self.runner.group), group=self.runner.group)
            output = _Output(bool(rgb8), _RAW_DTYPES[raw], True, _PRECISIONS[precision])
            self.runner.step(state, x.to(self.base.device), output)
