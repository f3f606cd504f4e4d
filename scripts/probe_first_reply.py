"""Does uploading the rest of a video's latents delay the first frame? A transport-only probe.

    python scripts/probe_first_reply.py --calls 30 --rounds 2

A minimal gRPC server (a subprocess, no model) answers a DecodeStream's first
message at once with one 480x832 RGB8 frame (1.2 MB), then reads the rest.
The client sends 480x832x81 bf16 latents (21 latent frames, 4.2 MB) two ways
and times the first reply:

- "at once": the first two latent frames, then the rest right behind them;
- "held": the first two latent frames, the rest only after the first reply
  (what `VaeClient.stream` does, see `vaed_client.core.StreamedLatents`).

No GPU: it measures the connection, not the decoder.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import torch

from vaed_client import channel as vchannel
from vaed_client import wire
from vaed_client._proto import vaed_pb2, vaed_pb2_grpc

HEAD = 2
FRAME = vaed_pb2.Tensor(dtype=vaed_pb2.UINT8, shape=[1, 1, 480, 832, 3], data=bytes(480 * 832 * 3))


class FirstFrameAtOnce(vaed_pb2_grpc.VaeDecoderServicer):
    def DecodeStream(self, requests: Iterator[vaed_pb2.LatentChunk], context: grpc.ServicerContext):
        next(requests)
        yield vaed_pb2.FrameChunk(chunk_index=0, first_frame=0, frames=FRAME)
        for _ in requests:
            pass
        yield vaed_pb2.FrameChunk(final=True)


def serve() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=vchannel.channel_options())
    vaed_pb2_grpc.add_VaeDecoderServicer_to_server(FirstFrameAtOnce(), server)
    print(server.add_insecure_port("127.0.0.1:0"), flush=True)
    server.start()
    server.wait_for_termination()


def first_reply_ms(stub: vaed_pb2_grpc.VaeDecoderStub, latents: torch.Tensor, held: bool) -> float:
    first_reply = threading.Event()

    def requests() -> Iterator[vaed_pb2.LatentChunk]:
        yield vaed_pb2.LatentChunk(latents=wire.to_message(latents[:, :, :HEAD]))
        if held:
            first_reply.wait(5.0)
        yield vaed_pb2.LatentChunk(latents=wire.to_message(latents[:, :, HEAD:]))

    started = time.perf_counter()
    first = None
    for _ in stub.DecodeStream(requests()):
        if first is None:
            first = time.perf_counter() - started
            first_reply.set()
    assert first is not None
    return first * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=30, help="calls per variant and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    server = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, text=True)
    try:
        port = server.stdout.readline().strip()  # type: ignore[union-attr]
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=vchannel.channel_options())
        stub = vaed_pb2_grpc.VaeDecoderStub(channel)
        latents = torch.randn(1, 16, 21, 60, 104, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
        first_reply_ms(stub, latents, held=True)  # connection set-up
        for r in range(args.rounds):
            for held in (False, True):
                times = [first_reply_ms(stub, latents, held) for _ in range(args.calls)]
                print(f"round {r + 1} {'held' if held else 'at once':>8}: first reply median "
                      f"{statistics.median(times):.2f} ms, min {min(times):.2f}, max {max(times):.2f}", flush=True)
    finally:
        server.kill()


if __name__ == "__main__":
    main()
