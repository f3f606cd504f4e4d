"""`ShardedEngine`: one video decoded by every rank of a torch.distributed group.

Shape of the design (one process per GPU):

- rank 0 lives in the server process, wraps that GPU's ordinary
  `DecodeEngine` (same weights, same fast paths) and implements the engine
  interface (`vaed.engine_protocol.Engine`): `new_state()`,
  `decode_frame(state, latent_frame, output) -> DecodedGroup` (frames on rank
  0's device), `free(state)`; input preparation, postprocessing and
  `decode_video` are the interface's own, shared with the one-GPU engine. The
  server's device worker calls it exactly like a one-GPU engine, so frames
  still stream per latent chunk and DecodeStream sessions work sharded.
- ranks 1.. are follower processes (see launch.py) that hold their own
  `DecodeEngine` and run `Follower.run()`: a loop that receives a small step
  descriptor from rank 0 (op, session id, latent shape, frame index, output
  spec, axis), then the latent frame itself, and decodes their shard.
- Descriptors (`StepHeader`) go over a gloo "control" group on the CPU with a
  long timeout (followers wait there while the server is idle; an NCCL
  collective waiting that long would trip the NCCL watchdog). A follower
  gives up after `control_timeout` without a descriptor, so rank 0 sends a
  no-op (`keepalive`, called from the device worker's loop) every quarter of
  it while no step is sent. Latents, halos, the attention
  gather and the frames go over the data group (NCCL between GPUs, gloo on CPU).
- The plan (axis, shard sizes) is decided by rank 0 on a session's first
  latent frame. A latent too small for the group (see plan.py) is decoded on
  rank 0 alone by the wrapped engine -- followers never hear of it, and its
  output is bit-identical to the one-GPU engine's.
- A session's state on every rank is its own cache list (per rank, the
  shard's own frames), so sessions interleave per latent frame like one-GPU sessions.

Failure model: a rank that dies or raises mid-step leaves the others blocked
in a collective until the data group's timeout; the engine then marks itself
broken (`healthy` False) and raises `ShardGroupError` for the failed call.
Later sessions decode on rank 0 alone; `describe()` (ModelInfo.parallel) then
says "off" and the health entry `spatial` turns NOT_SERVING.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ..choices import Kernels, Layout, Parallel, Precision, SpatialAxis
from ..engine import DecodeEngine
from ..engine_protocol import DecodedGroup, Engine, EngineInfo, OutputSpec
from ..errors import ShardGroupError
from ..identity import EngineIdentity
from ..patches.ops import OpSet
from .comm import gather_along, group_rank_world
from .forward import ShardContext, check_shardable, decoder_forward
from .inner_ops import resolve_inner_ops
from .plan import ShardPlan, plan_shards, split_sizes

log = logging.getLogger(__name__)

OP_STOP, OP_FRAME, OP_FREE, OP_NOOP, OP_STATS = 0, 1, 2, 3, 4
_RAW_DTYPES: list[torch.dtype | None] = [None, torch.float32, torch.float16, torch.bfloat16]
# the step header's codes: an index into these
_AXES = (SpatialAxis.HEIGHT, SpatialAxis.WIDTH)
_PRECISIONS = tuple(Precision)
# how long a follower waits for the next descriptor by default: gloo keeps a timeout in
# milliseconds, 24 days stays under 2**31 ms (rank 0's keepalive covers longer idles)
DEFAULT_CONTROL_TIMEOUT = datetime.timedelta(days=24)


@dataclass(frozen=True)
class StepHeader:
    """One step descriptor, broadcast on the control group as int64[LEN]. OP_FRAME fills every
    field; OP_STATS puts `reset` in `sid`; the others send the op alone."""

    op: int
    sid: int = 0
    b: int = 0
    z: int = 0
    h: int = 0
    w: int = 0
    index: int = 0  # the session's latent frame
    rgb8: int = 0
    raw_dtype: int = 0  # index into _RAW_DTYPES
    axis: int = 0  # index into _AXES
    precision: int = 0  # index into _PRECISIONS

    LEN: ClassVar[int] = 11  # its fields (asserted below the class)

    def tensor(self) -> torch.Tensor:
        return torch.tensor(dataclasses.astuple(self), dtype=torch.int64)

    @classmethod
    def of(cls, t: torch.Tensor) -> StepHeader:
        return cls(*t.tolist())

    def output(self) -> OutputSpec:
        """The frame's output spec on a follower (its latents arrive denormalized)."""
        return OutputSpec(bool(self.rgb8), _RAW_DTYPES[self.raw_dtype], True, _PRECISIONS[self.precision])


assert StepHeader.LEN == len(dataclasses.fields(StepHeader)), "StepHeader.LEN must count its fields"


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


def _inner_ops(base: DecodeEngine, kernels: str, precision: str) -> OpSet:
    """The op set of a precision tier: the one the wrapped engine prepared for it (its start-up
    checks and per-op switches included), else the lossless set, else plain torch."""
    if kernels != Kernels.OFF:
        try:
            return base.fast_paths.ops_for(precision)
        except KeyError:  # tier not prepared (e.g. kernels off on this device)
            pass
    return resolve_inner_ops(kernels)


class _ShardRunner:
    """What every rank does for one sharded latent frame (rank 0 and followers alike)."""

    def __init__(self, base: DecodeEngine, data_group: dist.ProcessGroup | None, kernels: str) -> None:
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
        if self.layout == Layout.CHANNELS_LAST:
            return x.contiguous(memory_format=torch.channels_last_3d)
        return x.contiguous()

    @torch.inference_mode()
    def step(self, state: ShardedState, x: torch.Tensor, output: OutputSpec) -> torch.Tensor | None:
        """x: the whole (denormalized, compute-dtype) latent frame [B, z, 1, h, w] on this rank's
        device. Returns the gathered postprocessed frames on rank 0, None elsewhere."""
        plan = state.plan
        assert plan is not None and state.cache is not None
        vae = self.base.vae
        shard = x.narrow(plan.dim, plan.offsets[self.rank], plan.sizes[self.rank])
        shard = vae.post_quant_conv(self.to_layout(shard))  # 1x1x1: local
        ctx = ShardContext(self.group, self.rank, plan, self.ops(output.precision))
        out = decoder_forward(ctx, vae.decoder, shard, state.cache, first_chunk=state.next_latent_frame == 0)
        frames = self.base.finish(out, output)  # local: unpatchify maps a latent row to `patch` rows
        state.next_latent_frame += 1
        # RGB8 is [B, t, H, W, 3]; RAW is [B, 3, t, H, W]
        dim = plan.dim - 1 if output.rgb8 else plan.dim
        sizes = plan.scaled(frames.shape[dim] // plan.sizes[self.rank])
        return gather_along(frames, dim, sizes, self.group)


class ShardedEngine(Engine):
    """Rank 0's engine over a group: the engine interface, decoded by all ranks.

    `base` is rank 0's `DecodeEngine` (vaed.engine); `data_group` carries tensors
    (None = the default group), `control_group` the step descriptors (gloo).
    `axis` is "auto" | "height" | "width"; `min_pixels` the output frame size below
    which a session stays on one GPU (0: shard whenever the latent is large enough);
    `control_timeout` how long the followers wait for the next descriptor.
    """

    def __init__(
        self,
        base: DecodeEngine,
        *,
        data_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        axis: str = SpatialAxis.AUTO,
        min_pixels: int = 0,
        kernels: str = Kernels.AUTO,
        launched: Any = None,
        control_timeout: datetime.timedelta = DEFAULT_CONTROL_TIMEOUT,
    ) -> None:
        axis = SpatialAxis.parse(axis, "axis")
        rank, world = group_rank_world(data_group)
        if rank != 0:
            raise ValueError(f"ShardedEngine runs on the group's rank 0; this is rank {rank} (run Follower)")
        self.base = base
        # the engine interface's state is the wrapped engine's: the same constants, the same bytes
        self.facts, self.device, self.dtype = base.facts, base.device, base.dtype
        self.latent_input = base.latent_input
        self.axis = axis
        self.min_pixels = min_pixels
        self.world = world
        self.control = control_group
        self.runner = _ShardRunner(base, data_group, kernels)
        self._healthy = True
        self._broken: str | None = None  # why the group broke
        # a no-op every quarter of the followers' wait; any descriptor counts (monotonic clock)
        self.keepalive_interval = control_timeout.total_seconds() / 4
        self._last_sent = time.monotonic()
        self._launched = launched  # a launch.ShardGroup whose processes this engine stops
        self._sids = itertools.count(1)
        self.sharded_frames = 0  # latent frames decoded by the whole group (metrics, tests)
        self.local_frames = 0  # latent frames decoded on rank 0 alone (too small, or group broken)
        self._comm_device = torch.device("cpu") if dist.get_backend(data_group) == "gloo" else base.device
        # rank 0's with the group: sharded frames are within a tolerance of one GPU's, not its bits
        self._identity = dataclasses.replace(base.identity, parallel=self.describe())

    # -- the engine interface ------------------------------------------------------------

    @property
    def info(self) -> EngineInfo:
        return self.base.info

    @property
    def identity(self) -> EngineIdentity:
        return self._identity

    @property
    def graphs(self) -> Any:
        """Rank 0's captured calls: sessions too small to shard decode with them (warm-up captures them)."""
        return self.base.graphs

    @property
    def vae(self) -> Any:
        return self.base.vae

    @property
    def healthy(self) -> bool:
        return self._healthy

    def describe(self) -> str:
        """ModelInfo.parallel: "spatial x2 (axis auto, shard from 0 px)"; "off" once the group
        broke (every session then decodes on rank 0 alone)."""
        if self._broken is not None:
            return Parallel.OFF
        return f"spatial x{self.world} (axis {self.axis}, shard from {self.min_pixels} px)"

    def health_entries(self) -> dict[str, bool]:
        """The group's own health entry: serving until it breaks or stops."""
        return {"spatial": self._healthy}

    def plan_for(self, h: int, w: int) -> ShardPlan | None:
        """The plan a latent of h x w gets on this group (None: one GPU)."""
        return plan_shards(
            h, w, self.world, self.axis, scale_spatial=self.base.scale_spatial, min_pixels=self.min_pixels
        )

    def new_state(self) -> ShardedState:
        return ShardedState(sid=next(self._sids))

    def decode_frame(self, state: ShardedState, latent_frame: torch.Tensor, output: OutputSpec) -> DecodedGroup:
        """Decode one latent frame [B, z, 1, h, w]; returns the engine's DecodedGroup on rank 0.

        Callable from any thread (the server's device worker): NCCL takes the
        current CUDA device of the calling thread, so it is set here.
        """
        with _device_scope(self.base.device):
            return self._decode_frame(state, latent_frame, output)

    @torch.inference_mode()
    def _decode_frame(self, state: ShardedState, latent_frame: torch.Tensor, output: OutputSpec) -> DecodedGroup:
        b, z, t, h, w = latent_frame.shape
        if t != 1:
            raise ValueError(f"decode_frame takes one latent frame, got T={t}")
        if state.shape is None:
            state.shape = (b, h, w)
            # a broken group degrades to one GPU for new sessions: rank 0 keeps serving
            state.plan = self.plan_for(h, w) if self._healthy else None
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
        x = self.prepare_input(latent_frame, output)  # the wrapped engine's constants: the same bytes as one GPU
        index = state.next_latent_frame
        header = StepHeader(
            OP_FRAME, state.sid, b, z, h, w, index, int(output.rgb8), _code(_RAW_DTYPES, output.raw_dtype, "raw dtype"),
            _AXES.index(plan.axis), _code(_PRECISIONS, output.precision, "precision"),
        )  # fmt: skip
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
        state.next_output_frame += frames.shape[output.time_dim]
        return group

    def free(self, state: ShardedState) -> None:
        """Drop the session's caches on every rank (a no-op for followers if it never went sharded)."""
        if state.local is not None:
            self.base.free(state.local)
            state.local = None
        if state.cache is not None:
            state.cache = None
            if self._healthy:
                try:
                    self._send_header(StepHeader(OP_FREE, state.sid))
                except Exception as exc:  # the group is gone; the state is freed anyway
                    self._fail(exc)

    def peak_memory(self, reset: bool = False) -> list[int]:
        """Peak allocated bytes on each rank's device (rank order; 0 on CPU); `reset` starts a new window."""
        self._check_healthy()
        self._send_header(StepHeader(OP_STATS, int(reset)))
        return _exchange_peak(self.base.device, self.control, reset)

    def keepalive(self, force: bool = False) -> None:
        """A no-op step every rank takes, sent when no descriptor went out for `keepalive_interval`
        (or at once with `force`); nothing once the group broke or stopped. The device worker
        calls it on every pass of its loop. Raises ShardGroupError when the group fails it."""
        if not self._healthy or (not force and time.monotonic() - self._last_sent < self.keepalive_interval):
            return
        try:
            self._send_header(StepHeader(OP_NOOP))
        except Exception as exc:
            self._fail(exc)
            raise ShardGroupError(f"the sharded group failed its keepalive: {exc}") from exc

    def close(self) -> None:
        """Stop the followers (and the processes launch.py started); idempotent."""
        if self._healthy:
            try:
                self._send_header(StepHeader(OP_STOP))
            except Exception as exc:  # already broken: nothing to tell
                log.warning("could not stop the followers cleanly: %s", exc)
            self._healthy = False
        if self._launched is not None:
            # followers of a broken group may sit in a collective forever: do not wait for them
            self._launched.join(timeout=60.0 if self._broken is None else 0.0)
            self._launched = None

    # -- internals ------------------------------------------------------------------------

    def _check_healthy(self) -> None:
        if not self._healthy:
            raise ShardGroupError("the sharded group is stopped or broken")

    def _fail(self, exc: BaseException) -> None:
        log.error("sharded group broken: %s", exc)
        self._healthy = False
        self._broken = str(exc) or type(exc).__name__

    def _send_header(self, header: StepHeader) -> None:
        # A follower that died is not always noticed by the collective: a gloo broadcast to a
        # killed rank hung on the (24-day) control timeout in a loaded CPU test run. The
        # processes this engine launched are checked first (a waitpid each).
        exited = self._launched.exited() if self._launched is not None else []
        if exited:
            raise ShardGroupError(", ".join(f"follower pid {pid} exited with code {code}" for pid, code in exited))
        dist.broadcast(header.tensor(), src=_global0(self.control), group=self.control)
        self._last_sent = time.monotonic()

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
        base: DecodeEngine,
        *,
        data_group: dist.ProcessGroup | None = None,
        control_group: dist.ProcessGroup | None = None,
        kernels: str = Kernels.AUTO,
        control_timeout: datetime.timedelta = DEFAULT_CONTROL_TIMEOUT,
    ) -> None:
        self.runner = _ShardRunner(base, data_group, kernels)
        if self.runner.rank == 0:
            raise ValueError("rank 0 drives the group (ShardedEngine); followers are ranks 1..")
        self.base = base
        self.control = control_group
        self.states: dict[int, ShardedState] = {}
        self.control_timeout = control_timeout
        self._comm_device = torch.device("cpu") if dist.get_backend(data_group) == "gloo" else base.device

    def _next_header(self) -> StepHeader:
        """The next descriptor; raises after `control_timeout` without one (rank 0 is gone or
        stopped sending keepalives)."""
        t = torch.empty(StepHeader.LEN, dtype=torch.int64)
        work = dist.broadcast(t, src=_global0(self.control), group=self.control, async_op=True)
        work.wait(timeout=self.control_timeout)
        return StepHeader.of(t)

    def run(self) -> None:
        while True:
            header = self._next_header()
            op, sid = header.op, header.sid
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
            b, h, w, index = header.b, header.h, header.w, header.index
            state = self.states.get(sid)
            if state is None:
                if index != 0:
                    raise ShardGroupError(f"session {sid} starts at latent frame {index}, expected 0")
                axis = _AXES[header.axis]
                plan = ShardPlan(axis, split_sizes(h if axis == SpatialAxis.HEIGHT else w, self.runner.world))
                state = ShardedState(sid=sid, plan=plan, cache=[None] * self.base.num_convs, shape=(b, h, w))
                self.states[sid] = state
            if state.next_latent_frame != index:
                raise ShardGroupError(
                    f"session {sid}: rank 0 sent frame {index}, this rank is at {state.next_latent_frame}"
                )
            x = torch.empty((b, header.z, 1, h, w), dtype=self.base.dtype, device=self._comm_device)
            dist.broadcast(x, src=_global0(self.runner.group), group=self.runner.group)
            self.runner.step(state, x.to(self.base.device), header.output())
