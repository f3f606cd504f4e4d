"""Group set-up: rank 0 in the calling process, ranks 1.. as spawned processes.

`start_sharded_engine(GroupConfig(...))` is what a server (or a test, or the
benchmark) calls: it spawns one follower process per extra device
(`torch.multiprocessing`, spawn context: CUDA cannot be forked), joins them in
a torch.distributed group (NCCL when the devices are GPUs, gloo on CPU) plus a
gloo control group for the step descriptors, waits until every follower has
loaded its model, and returns rank 0's `ShardedEngine`. `engine.close()`
stops and joins the followers.

Why processes and not threads: one Python process drives one GPU at full
speed only when its host thread is free (~274 launches and ~53 ms of host
dispatch per 480p chunk, measured on an H200); two GPUs from one interpreter would share
one GIL. NCCL also needs one rank per process here.

NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is put in the
environment before the group starts unless the caller already set it.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..choices import Kernels, Layout, SpatialAxis
from ..heap import freeze_startup_heap
from .engine import DEFAULT_CONTROL_TIMEOUT, Follower, ShardedEngine, ShardGroupError

log = logging.getLogger(__name__)

# the control group waits for the next step while the server idles; rank 0's device worker
# calls engine.keepalive(), which sends a no-op every quarter of it (vaed.worker)
CONTROL_TIMEOUT = DEFAULT_CONTROL_TIMEOUT


@dataclass(frozen=True)
class GroupConfig:
    model: str                        # a --model spec, loaded by every rank
    devices: tuple[str, ...]          # one per rank, rank 0 first ("cuda:0", "cuda:1" / "cpu", "cpu")
    dtype: str = "bfloat16"
    kernels: str = Kernels.AUTO
    layout: str = Layout.AUTO
    axis: str = SpatialAxis.AUTO
    min_pixels: int = 0
    timeout_s: float = 300.0          # data-group collectives (a dead rank surfaces after this)
    # a follower's wait for the next step descriptor (tests shorten it; rank 0 keeps it alive)
    control_timeout_s: float = CONTROL_TIMEOUT.total_seconds()
    backend: str | None = None        # None: nccl for cuda devices, else gloo
    init_method: str | None = None    # None: tcp://127.0.0.1:<free port>
    cpu_threads: int = 1              # torch threads of each CPU follower (CPU groups: tests, development)
    engine_options: dict[str, Any] = field(default_factory=dict)  # extra DecodeEngine options

    @property
    def world(self) -> int:
        return len(self.devices)

    @property
    def control_timeout(self) -> datetime.timedelta:
        return datetime.timedelta(seconds=self.control_timeout_s)

    def resolved_backend(self) -> str:
        if self.backend:
            return self.backend
        return "nccl" if all(d.startswith("cuda") for d in self.devices) else "gloo"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _load_base(cfg: GroupConfig, device: str) -> Any:
    from vaed.engine import DecodeEngine

    return DecodeEngine.load(
        cfg.model, device=device, dtype=cfg.dtype, kernels=cfg.kernels, layout=cfg.layout, **cfg.engine_options
    )


def _join_group(cfg: GroupConfig, rank: int, init_method: str) -> dist.ProcessGroup:
    """init the default (data) group and create the gloo control group; returns the control group."""
    dist.init_process_group(
        cfg.resolved_backend(),
        init_method=init_method,
        rank=rank,
        world_size=cfg.world,
        timeout=datetime.timedelta(seconds=cfg.timeout_s),
    )
    # the start-up barrier on it waits for every model to load: never shorter than the data group's
    wait = max(cfg.control_timeout, datetime.timedelta(seconds=cfg.timeout_s))
    return dist.new_group(backend="gloo", timeout=wait)


def _follower_main(rank: int, cfg: GroupConfig, init_method: str) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank{rank} %(name)s: %(message)s")
    device = cfg.devices[rank]
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    else:
        torch.set_num_threads(cfg.cpu_threads)  # CPU ranks share the host's cores: no oversubscription
    control = _join_group(cfg, rank, init_method)
    try:
        base = _load_base(cfg, device)
        follower = Follower(base, control_group=control, kernels=cfg.kernels, control_timeout=cfg.control_timeout)
        dist.barrier(group=control)  # ready: rank 0 waits here for every model
        freeze_startup_heap()  # a GC pause here would stall every rank's step (vaed.heap)
        follower.run()
    except BaseException:
        # die at once: rank 0's next collective then fails (gloo) or times out (NCCL)
        # instead of this rank waiting in a collective the others never join
        log.exception("rank %d failed; leaving the group", rank)
        logging.shutdown()
        os._exit(1)
    # Stopped by rank 0: exit without destroy_process_group. On two H200s it blocked
    # until rank 0's 60 s join timeout terminated the process (rank 0 destroys its
    # groups only after joining); the process's exit releases the communicators.
    logging.shutdown()
    os._exit(0)


class ShardGroup:
    """The follower processes of one group (rank 0 is the caller)."""

    def __init__(self, procs: list[Any]) -> None:
        self.procs = procs

    def exited(self) -> list[tuple[int | None, int]]:
        """(pid, exit code) of every follower that is no longer running."""
        return [(p.pid, p.exitcode) for p in self.procs if p.exitcode is not None]

    def join(self, timeout: float = 60.0) -> None:
        for p in self.procs:
            p.join(max(timeout, 0.1))
            if p.is_alive():
                log.warning("follower pid %s did not stop; terminating it", p.pid)
                p.terminate()
                p.join(5)
        if dist.is_initialized():
            dist.destroy_process_group()


def start_sharded_engine(cfg: GroupConfig, base: Any = None) -> ShardedEngine:
    """Spawn ranks 1.., join the group as rank 0 and return the engine (models loaded everywhere).

    `base` is rank 0's existing DecodeEngine (a server shares its GPU-0 engine);
    None loads one on `cfg.devices[0]`.
    """
    if cfg.world < 2:
        raise ValueError(f"a sharded group needs at least 2 devices, got {list(cfg.devices)}")
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    # a dead follower must fail rank 0's collective with an error, not kill the server process
    # (torch's default, 3, tears the process down after the watchdog timeout); 2 = clean up only
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    init_method = cfg.init_method or f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower_main, args=(r, cfg, init_method), daemon=True) for r in range(1, cfg.world)]
    for p in procs:
        p.start()
    group = ShardGroup(procs)
    try:
        if cfg.devices[0].startswith("cuda"):
            torch.cuda.set_device(torch.device(cfg.devices[0]))
        control = _join_group(cfg, 0, init_method)
        if base is None:
            base = _load_base(cfg, cfg.devices[0])
        dist.barrier(group=control)
    except BaseException as exc:
        for p in procs:
            p.terminate()
        group.join(5)
        if isinstance(exc, Exception):
            raise ShardGroupError(f"the sharded group did not start: {exc}") from exc
        raise
    log.info("sharded group ready: %d ranks on %s (%s)", cfg.world, ", ".join(cfg.devices), cfg.resolved_backend())
    return ShardedEngine(
        base,
        control_group=control,
        axis=cfg.axis,
        min_pixels=cfg.min_pixels,
        kernels=cfg.kernels,
        launched=group,
        control_timeout=cfg.control_timeout,
    )
