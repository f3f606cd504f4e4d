"""The client's own share of a call's start and end: from the server's first frame group sent to
`stream()`'s first chunk and to `decode()`'s first reply placed in its video, from its last group sent to
`stream()`'s end and to `decode()`'s return, and what freeing `decode()`'s video costs afterwards.

    python benchmarks/client_tail.py --reps 12            # 480x832x81, the fast tier's cadence

A paced server in a process of its own (its GIL stays out of the client's) answers each
DecodeStream with 21 prebuilt uint8 480x832 groups (1 frame, then 4), one every `--period`
seconds (34 ms: a steady fast-tier chunk on an H200), then the final message, and writes the
wall times of each call's first and last group sends to a file; the client runs the real
`VaeClient`. The
latents' values do not matter to it. Calls alternate `stream()` and `decode()`; each video is
freed after its clock stops, and that free is timed on its own.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from typing import Any

import numpy as np
from client_clock import watch_placements

GROUPS = 21  # a 480x832x81 video: latent frame 0 decodes to 1 frame, each later one to 4


def serve(sends_path: str, period: float) -> None:
    """The paced server (this script with --serve): prints its port, runs until killed."""
    import grpc

    from vaed_client import channel, tensors
    from vaed_client._proto import vaed_pb2, vaed_pb2_grpc

    rng = np.random.default_rng(0)
    counts = [1] + [4] * (GROUPS - 1)
    groups = [tensors.to_message(rng.integers(0, 255, (1, n, 480, 832, 3), dtype=np.uint8)) for n in counts]
    firsts = [sum(counts[:i]) for i in range(GROUPS)]
    sends = open(sends_path, "a")

    class Paced(vaed_pb2_grpc.VaeDecoderServicer):
        def GetModelInfo(self, request: Any, context: Any) -> Any:
            return vaed_pb2.ModelInfo(model="paced", z_dim=16, scale_factor_temporal=4, scale_factor_spatial=8,
                                      latents_mean=[0.0] * 16, latents_std=[1.0] * 16,
                                      compute_dtype=vaed_pb2.BFLOAT16, device="cpu", random_weights=True,
                                      max_message_bytes=channel.MAX_MESSAGE_BYTES)

        def DecodeStream(self, request_iterator: Any, context: Any) -> Any:
            # the upload is read beside the answer, as the real server does
            threading.Thread(target=lambda: all(True for _ in request_iterator), daemon=True).start()
            start = time.perf_counter() + 0.02
            first_sent = 0.0
            for i, (first, frames) in enumerate(zip(firsts, groups, strict=True)):
                time.sleep(max(0.0, start + period * i - time.perf_counter()))
                first_sent = first_sent or time.time()
                yield vaed_pb2.FrameChunk(request_id="paced", chunk_index=i, first_frame=first, frames=frames)
            # the generator resumes once gRPC has taken the last group: its send time
            sends.write(f"{first_sent} {time.time()}\n")
            sends.flush()
            yield vaed_pb2.FrameChunk(request_id="paced", final=True)

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channel.channel_options())
    vaed_pb2_grpc.add_VaeDecoderServicer_to_server(Paced(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    print(port, flush=True)
    server.wait_for_termination()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=12)
    parser.add_argument("--period", type=float, default=0.034, help="seconds between the server's groups")
    parser.add_argument("--serve", metavar="SENDS_FILE", help=argparse.SUPPRESS)  # the server process
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.period)
        return 0
    from vaed_client import VaeClient, keep_freed_memory

    placed = watch_placements(clock=time.time)  # wall time: the server's sends are another process's

    print(f"client malloc: {keep_freed_memory()}")
    sends = os.path.join(tempfile.mkdtemp(), "sends")
    open(sends, "w").close()
    server = subprocess.Popen([sys.executable, __file__, "--serve", sends, "--period", str(args.period)],
                              stdout=subprocess.PIPE, text=True)
    try:
        target = f"127.0.0.1:{int(server.stdout.readline())}"  # type: ignore[union-attr]
        latents = np.zeros((1, 16, GROUPS, 60, 104), np.float32)
        heads: dict[str, list[float]] = {"stream()": [], "decode()": []}
        tails: dict[str, list[float]] = {"stream()": [], "decode()": []}
        frees: list[float] = []
        with VaeClient(target) as client:
            list(client.stream(latents[:, :, :2]))  # connection and first-use warm-up
            for _ in range(args.reps):
                time.sleep(0.2)
                first = None
                for _chunk in client.stream(latents):
                    first = first or time.time()
                end = time.time()
                first_sent, last_sent = sends_of_last_call(sends)
                heads["stream()"].append(first - first_sent)
                tails["stream()"].append(end - last_sent)
                time.sleep(0.2)
                placed.clear()
                video = client.decode(latents)
                end = time.time()
                first_sent, last_sent = sends_of_last_call(sends)
                heads["decode()"].append(placed[0] - first_sent)
                tails["decode()"].append(end - last_sent)
                started = time.perf_counter()
                del video
                frees.append(time.perf_counter() - started)
    finally:
        server.kill()
    for call in heads:
        print(f"{call}: from the first group sent to its first frames, median "
              f"{statistics.median(heads[call]) * 1e3:.1f} ms, max {max(heads[call]) * 1e3:.1f} ms; from the "
              f"last group sent to its end, median {statistics.median(tails[call]) * 1e3:.1f} ms, "
              f"max {max(tails[call]) * 1e3:.1f} ms")
    print(f"freeing decode()'s video (after its clock): median {statistics.median(frees) * 1e3:.1f} ms, "
          f"max {max(frees) * 1e3:.1f} ms")
    return 0


def sends_of_last_call(path: str) -> tuple[float, float]:
    """(first group's send, last group's send) of the server's latest call, wall clock."""
    with open(path) as f:
        first, last = f.read().splitlines()[-1].split()
    return float(first), float(last)


if __name__ == "__main__":
    sys.exit(main())
