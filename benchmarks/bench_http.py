"""Server-side video end to end: diffusers' `remote_decode` (mp4, pt + partial_postprocess), the
streamed fMP4 route, and gRPC's MP4 formats (`VaeClient.decode(output_type="mp4")`, lossy and
lossless) against the gRPC RGB8 decode of the same latents, through a real `vaed serve`.

    python benchmarks/bench_http.py --model random:wan2.1 --shape 1,16,21,60,104 --reps 3 \
        [--precision fast] [--latents smooth] [--dtype bfloat16]
    python benchmarks/bench_http.py --device cpu --model random:wan2.1-tiny --shape 1,4,21,60,104

Per output: seconds until the whole answer is at the client (median of --reps), bytes on the
wire, and for mp4 the PSNR of its frames against the RGB8 frames; for the stream, seconds until
the first fMP4 fragment (`moof`) is at the client, over HTTP and over gRPC; for the streamed
pt + partial_postprocess answer, seconds until frame 0's bytes are; and the server process's CPU
cores in use (CPU seconds / wall seconds from /proc) during the gRPC RGB8 and MP4 decodes and
remote_decode's mp4 and pt + partial_postprocess calls.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import requests
import torch

from profile_fast import smooth_latents
from vaed_process import print_call_lines, start_vaed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(reps: int, call: Callable[[], Any]) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(reps):
        # the last result freed before the clock starts, not charged to the next call: unmapping
        # a 97 MB RGB8 video took ~10 ms on a 2-core machine (a 720p one is 224 MB)
        result = None
        started = time.perf_counter()
        result = call()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid`, all its threads (from /proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def timed_cores(pid: int, reps: int, call: Callable[[], Any]) -> tuple[float, Any, float]:
    """`timed`, and the server's CPU cores in use over those calls."""
    cpu, wall = cpu_seconds(pid), time.perf_counter()
    median, result = timed(reps, call)
    return median, result, (cpu_seconds(pid) - cpu) / (time.perf_counter() - wall)


def mp4_frames(data: bytes) -> np.ndarray:
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def first_fragment_s(endpoint: str, sent: dict[str, Any]) -> tuple[float, float, int]:
    """(seconds to the first `moof` at the client, seconds to the end, bytes) of one streamed call."""
    started = time.perf_counter()
    first, data = None, b""
    with requests.post(endpoint, data=sent["data"], headers=sent["headers"],
                       params={**sent["params"], "stream": "true"}, stream=True, timeout=600) as response:
        response.raise_for_status()
        for chunk in response.iter_content(chunk_size=None):
            data += chunk
            if first is None and b"moof" in data:
                first = time.perf_counter() - started
    return first or float("nan"), time.perf_counter() - started, len(data)


def first_frame_s(endpoint: str, sent: dict[str, Any], frame_bytes: int) -> float:
    """Seconds until frame 0's bytes of a streamed pt + partial_postprocess answer are at the client."""
    started, first = time.perf_counter(), float("nan")
    with requests.post(endpoint, data=sent["data"], headers=sent["headers"], params=sent["params"],
                       stream=True, timeout=600) as response:
        response.raise_for_status()
        got = 0
        # a chunk size: with none, urllib3 reads a body of known length to its end
        for chunk in response.iter_content(chunk_size=frame_bytes):
            got += len(chunk)
            if got >= frame_bytes:
                first = time.perf_counter() - started
                break
        for _ in response.iter_content(chunk_size=1 << 20):  # the rest, so the call ends OK
            pass
    return first


def grpc_first_fragment_s(client: Any, latents: torch.Tensor) -> tuple[float, float, int]:
    """As `first_fragment_s`, for `VaeClient.decode(output_type="mp4")` on a channel already
    connected, as a worker's client keeps it (a fresh connection adds HTTP/2's flow-control ramp
    over the upload: 35-39 ms more for 19 MB at 720p on an H200). The first MP4 bytes are one
    reply (the init segment with frame 0's fragment); `CallReport.first_data_seconds` is their
    arrival from the call's start."""
    from vaed_client import CallReport

    report = CallReport()
    started = time.perf_counter()
    data = client.decode(latents, output_type="mp4", report=report)
    total = time.perf_counter() - started
    assert b"moof" in data, "no fMP4 fragment in the answer"
    return report.first_data_seconds or float("nan"), total, len(data)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--shape", default="1,16,21,60,104", help="latent shape B,z,T,h,w")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--gpu", default="0")
    parser.add_argument("--device", choices=["cpu"], help="serve on the CPU instead of --gpu")
    parser.add_argument("--precision", choices=["lossless", "fast"], help="the server's --precision (its default if unset)")
    parser.add_argument("--latents", choices=["white", "smooth"], default="white",
                        help="white noise, or low-frequency latents (structured frames, as real videos compress)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the latents' dtype (the gRPC client sends float32 as bf16 to a bf16 server; "
                             "HTTP bodies go as given)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("server_args", nargs="*", help="extra `vaed serve` flags after --")
    args = parser.parse_args()
    from diffusers.utils.remote_utils import prepare_decode, remote_decode

    from vaed_client import VaeClient

    shape = [int(s) for s in args.shape.split(",")]
    generator = torch.Generator().manual_seed(0)
    if args.latents == "smooth":
        latents = smooth_latents(tuple(shape), generator)
    else:
        latents = torch.randn(*shape, generator=generator)
    latents = latents.to(getattr(torch, args.dtype))
    http_port = free_port()
    extra = ["--http-port", str(http_port)] + (["--device", "cpu"] if args.device else [])
    extra += ["--precision", args.precision] if args.precision else []
    extra += args.server_args
    proc, target, _ = start_vaed(args.model, None if args.device else args.gpu, extra)
    endpoint = f"http://127.0.0.1:{http_port}/"
    try:
        with VaeClient(target) as client:
            client.decode(latents[:, :, :2])  # connection and first-use warm-up
            grpc_s, rgb8, rgb8_cores = timed_cores(proc.pid, args.reps, lambda: client.decode(latents))
            client.decode(latents[:, :, :2], output_type="mp4")  # the packaging pool's first use
            grpc_mp4_s, grpc_mp4, mp4_cores = timed_cores(
                proc.pid, args.reps, lambda: client.decode(latents, output_type="mp4"))
            grpc_lossless_s, grpc_lossless = timed(
                args.reps, lambda: client.decode(latents, output_type="mp4", lossless=True))
            grpc_streams = [grpc_first_fragment_s(client, latents) for _ in range(args.reps)]
        rgb8 = np.asarray(rgb8)[0]
        assert np.array_equal(mp4_frames(grpc_lossless), rgb8), "gRPC MP4_LOSSLESS differs from gRPC RGB8"
        remote_decode(endpoint=endpoint, tensor=latents[:, :, :2], output_type="mp4", return_type="mp4")
        mp4_s, mp4, http_mp4_cores = timed_cores(proc.pid, args.reps, lambda: remote_decode(
            endpoint=endpoint, tensor=latents, output_type="mp4", return_type="mp4"))
        frames_s, frames, frames_cores = timed_cores(proc.pid, args.reps, lambda: remote_decode(
            endpoint=endpoint, tensor=latents, output_type="pt", partial_postprocess=True, return_type="pt"))
        assert np.array_equal(frames.numpy(), rgb8), "pt + partial_postprocess differs from gRPC RGB8"
        frame_bytes = rgb8[0].nbytes
        pt_firsts = [first_frame_s(endpoint, prepare_decode(latents, output_type="pt", partial_postprocess=True),
                                   frame_bytes) for _ in range(args.reps)]
        streams = [first_fragment_s(endpoint, prepare_decode(latents, output_type="mp4")) for _ in range(args.reps)]
    finally:
        proc.terminate()
        rest = proc.communicate(timeout=60)[0] or ""
    print_call_lines(rest)
    result = {
        "model": args.model, "shape": shape, "latents": args.latents, "frames": int(rgb8.shape[0]),
        "dtype": args.dtype, "body_bytes": latents.numel() * latents.element_size(),
        "grpc_rgb8_s": grpc_s, "rgb8_bytes": int(rgb8.nbytes),
        "http_pt_partial_s": frames_s, "http_pt_partial_first_frame_ms": statistics.median(pt_firsts) * 1e3,
        "server_cores_http_pt_partial": frames_cores, "server_cores_http_mp4": http_mp4_cores,
        "http_mp4_s": mp4_s, "mp4_bytes": len(mp4), "mp4_over_rgb8": len(mp4) / rgb8.nbytes,
        "mp4_psnr_db": psnr(mp4_frames(mp4), rgb8), "http_mp4_over_grpc_rgb8": mp4_s / grpc_s,
        "stream_first_fragment_ms": statistics.median(s[0] for s in streams) * 1e3,
        "stream_total_s": statistics.median(s[1] for s in streams),
        "grpc_mp4_s": grpc_mp4_s, "grpc_mp4_bytes": len(grpc_mp4), "grpc_mp4_over_grpc_rgb8": grpc_mp4_s / grpc_s,
        "grpc_mp4_psnr_db": psnr(mp4_frames(grpc_mp4), rgb8),
        "server_cores_grpc_rgb8": rgb8_cores, "server_cores_grpc_mp4": mp4_cores,
        "grpc_lossless_s": grpc_lossless_s, "grpc_lossless_bytes": len(grpc_lossless),
        "grpc_first_fragment_ms": statistics.median(s[0] for s in grpc_streams) * 1e3,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
