"""Load benchmark: N concurrent streaming sessions against one vaed server, for a set time,
through the real client (`AsyncVaeClient.session`, one event loop, one channel).

What it measures, per session and over all of them:

* throughput: output frames per second over the run (and latent frames per second);
* first frame: from opening a session to its first frame, p50 and p99 over every session run;
* inter-chunk gap: time between consecutive frame chunks of one session, p50 and p99;
  compared with the fair share, `N / (groups per second over all sessions)`: the gap each
  session would see if the server handed out its decode steps evenly (1.0x = perfectly fair);
* fairness: frames per second of the slowest session over the fastest;
* completeness: every session's frames arrive once, in order, as many as its latents decode to
  (a session that breaks this fails the run with exit code 1);
* the server's RSS, threads and open fds at start and end (and this process's), read from
  /proc: a leak shows as growth over a long run.

Each session pushes its latents one latent frame per message, as a generator would, iterates
its frames, and starts over with a new session until the time is up (a session started before
the end runs to its end). Latents are random normal: the decode time does not depend on values.

    # CPU, a short CI-sized run: starts `vaed serve` itself (tiny random model)
    python benchmarks/load.py --serve random:wan2.1-tiny --sessions 4 --seconds 20 --shape 1,4,5,16,16

    # H200: 16 sessions of 480x832x81 videos, lossless then fast, 120 s each
    python benchmarks/load.py --serve random:wan2.1 --gpu 0 --sessions 16 --seconds 120 --shape 1,16,21,60,104
    python benchmarks/load.py --serve random:wan2.1 --gpu 0 --sessions 16 --seconds 120 --shape 1,16,21,60,104 \
        --precision fast

    # against a running server (pass its pid for the server figures)
    python benchmarks/load.py --target 127.0.0.1:50051 --server-pid 1234 --sessions 8 --seconds 60

Prints one human-readable summary and, with --json PATH, writes every figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vaed_client import AsyncVaeClient
from vaed_client.wire import output_frames


@dataclass
class ProcessFigures:
    rss_bytes: int
    threads: int
    fds: int


def process_figures(pid: int) -> ProcessFigures:
    """RSS, threads and open fds of a Linux process, from /proc."""
    with open(f"/proc/{pid}/status") as f:
        status = dict(line.split(":", 1) for line in f if ":" in line)
    rss_kb = int(status["VmRSS"].split()[0])
    return ProcessFigures(rss_kb * 1024, int(status["Threads"]), len(os.listdir(f"/proc/{pid}/fd")))


@dataclass
class SessionStats:
    """One worker's figures over all the sessions it ran one after the other."""

    sessions: int = 0
    frames: int = 0
    latent_frames: int = 0
    groups: int = 0
    first_frame_s: list[float] = field(default_factory=list)
    gaps_s: list[float] = field(default_factory=list)
    busy_s: float = 0.0  # time inside sessions (the fps of this worker divides by it)
    errors: list[str] = field(default_factory=list)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


async def push_all(session: Any, latents: np.ndarray) -> None:
    """One latent frame per message, as a generator would push them, then the half-close."""
    for t in range(latents.shape[2]):
        await session.push(latents[:, :, t : t + 1])
    await session.close()


async def run_worker(client: AsyncVaeClient, latents: np.ndarray, end_at: float, options: dict[str, Any],
                     stats: SessionStats) -> None:
    expected = output_frames(latents.shape[2])
    while time.perf_counter() < end_at:
        opened = time.perf_counter()
        session = client.session(**options)
        next_frame = 0
        last: float | None = None

        pusher = asyncio.ensure_future(push_all(session, latents))
        try:
            async for chunk in session:
                now = time.perf_counter()
                if chunk.first_frame != next_frame:
                    stats.errors.append(f"frame {next_frame} expected, got {chunk.first_frame}")
                next_frame = chunk.end_frame
                if last is None:
                    stats.first_frame_s.append(now - opened)
                else:
                    stats.gaps_s.append(now - last)
                last = now
                stats.groups += 1
            await pusher
        except Exception as e:  # counted and reported: one failed session must not hide the others' figures
            stats.errors.append(f"{type(e).__name__}: {e}")
            pusher.cancel()
            session.cancel()
            return
        if next_frame != expected:
            stats.errors.append(f"{next_frame} frames of {expected}")
        stats.sessions += 1
        stats.frames += next_frame
        stats.latent_frames += latents.shape[2]
        stats.busy_s += time.perf_counter() - opened


async def run(args: argparse.Namespace, target: str | list[str]) -> list[SessionStats]:
    shape = tuple(int(d) for d in args.shape.split(","))
    rng = np.random.default_rng(0)
    latents = [rng.standard_normal(shape).astype(np.float32) for _ in range(args.sessions)]
    options: dict[str, Any] = dict(output_type=args.output_type)
    stats = [SessionStats() for _ in range(args.sessions)]
    async with AsyncVaeClient(target, timeout=None) as client:
        await client.model_info()  # the channel is connected before the clock starts
        end_at = time.perf_counter() + args.seconds
        await asyncio.gather(*(run_worker(client, x, end_at, options, s) for x, s in zip(latents, stats)))
    return stats


def summarize(stats: list[SessionStats], wall_s: float, n: int) -> dict[str, Any]:
    frames = sum(s.frames for s in stats)
    groups = sum(s.groups for s in stats)
    firsts = [v for s in stats for v in s.first_frame_s]
    gaps = [v for s in stats for v in s.gaps_s]
    fps = [s.frames / s.busy_s for s in stats if s.busy_s > 0]
    fair_gap = n * wall_s / groups if groups else float("nan")  # each session's gap under an even share
    return dict(
        sessions_completed=sum(s.sessions for s in stats),
        frames=frames,
        frames_per_s=frames / wall_s,
        latent_frames_per_s=sum(s.latent_frames for s in stats) / wall_s,
        first_frame_p50_s=percentile(firsts, 50),
        first_frame_p99_s=percentile(firsts, 99),
        gap_p50_s=percentile(gaps, 50),
        gap_p99_s=percentile(gaps, 99),
        fair_share_gap_s=fair_gap,
        gap_p99_over_fair_share=percentile(gaps, 99) / fair_gap if groups else float("nan"),
        slowest_over_fastest_fps=min(fps) / max(fps) if fps else float("nan"),
        errors=[e for s in stats for e in s.errors],
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--serve", metavar="MODEL", help="start `vaed serve --model MODEL` on a loopback port")
    where.add_argument("--target", help="a running server (host:port)")
    parser.add_argument("--gpu", help="with --serve: the GPU index (default: the CPU)")
    parser.add_argument("--server-pid", type=int, help="with --target: the server's pid, for its RSS/threads/fds")
    parser.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default 4)")
    parser.add_argument("--seconds", type=float, default=20.0, help="run time (default 20)")
    parser.add_argument("--shape", default="1,4,5,16,16", help="latents B,z_dim,T,h,w (default 1,4,5,16,16: tiny model)")
    parser.add_argument("--output-type", default="uint8", choices=["uint8", "raw"])
    parser.add_argument("--precision", choices=["lossless", "fast"], help="with --serve: the server's --precision")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("server_args", nargs="*", help="with --serve: more `vaed serve` flags (after --)")
    args = parser.parse_args()

    proc = None
    if args.serve:
        from vaed_process import start_vaed

        extra = ["--max-sessions", str(max(16, args.sessions)), *args.server_args]
        if args.gpu is None:
            extra = ["--device", "cpu", *extra]
        if args.precision:
            extra += ["--precision", args.precision]
        proc, target, _ = start_vaed(args.serve, args.gpu, extra)
        server_pid: int | None = proc.pid
    else:
        target, server_pid = args.target, args.server_pid
    try:
        server_start = process_figures(server_pid) if server_pid else None
        client_start = process_figures(os.getpid())
        started = time.perf_counter()
        stats = asyncio.run(run(args, target))
        wall_s = time.perf_counter() - started
        server_end = process_figures(server_pid) if server_pid else None
        client_end = process_figures(os.getpid())
    finally:
        if proc is not None:
            proc.terminate()
            proc.communicate(timeout=60)
    summary = summarize(stats, wall_s, args.sessions)
    summary.update(
        sessions=args.sessions, seconds=args.seconds, wall_s=wall_s, shape=args.shape,
        precision=args.precision or "server default", output_type=args.output_type,
        server_start=asdict(server_start) if server_start else None,
        server_end=asdict(server_end) if server_end else None,
        client_start=asdict(client_start), client_end=asdict(client_end),
        per_session=[dict(sessions=s.sessions, frames=s.frames, fps=s.frames / s.busy_s if s.busy_s else None,
                          gap_p99_s=percentile(s.gaps_s, 99)) for s in stats],
    )
    print_summary(summary)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    return 1 if summary["errors"] else 0


def print_summary(s: dict[str, Any]) -> None:
    ms = 1e3
    print(f"\n{s['sessions']} sessions x {s['seconds']:g} s, latents {s['shape']}, {s['precision']}, {s['output_type']}")
    print(f"  sessions completed {s['sessions_completed']}, frames {s['frames']} "
          f"({s['frames_per_s']:.1f} frames/s, {s['latent_frames_per_s']:.1f} latent frames/s)")
    print(f"  first frame   p50 {s['first_frame_p50_s'] * ms:8.1f} ms   p99 {s['first_frame_p99_s'] * ms:8.1f} ms")
    print(f"  chunk gap     p50 {s['gap_p50_s'] * ms:8.1f} ms   p99 {s['gap_p99_s'] * ms:8.1f} ms   "
          f"fair share {s['fair_share_gap_s'] * ms:.1f} ms (p99 = {s['gap_p99_over_fair_share']:.2f}x)")
    print(f"  fairness      slowest/fastest session fps {s['slowest_over_fastest_fps']:.2f}")
    for who in ("server", "client"):
        a, b = s[f"{who}_start"], s[f"{who}_end"]
        if a and b:
            print(f"  {who:7s} RSS {a['rss_bytes'] / 2**20:.0f} -> {b['rss_bytes'] / 2**20:.0f} MiB, "
                  f"threads {a['threads']} -> {b['threads']}, fds {a['fds']} -> {b['fds']}")
    if s["errors"]:
        print(f"  ERRORS ({len(s['errors'])}): {s['errors'][:5]}")
    else:
        print("  every session's frames complete and in order")


if __name__ == "__main__":
    sys.exit(main())
