"""Bytes an image-to-video encode puts on the wire, measured through a counting loopback proxy.

    python benchmarks/encode_wire_bytes.py                      # CPU, random:wan2.1-tiny, 480x832x81
    python benchmarks/encode_wire_bytes.py --gpu 0 --model random:wan2.1

WanImageToVideoPipeline encodes its image followed by num_frames - 1 zero frames. The real
`VaeClient.encode` sends that video to a real `vaed serve --encode` (CPU by default: the bytes do
not depend on the device or the weights) through a TCP proxy that counts every byte each way,
HTTP/2 framing and headers included; a fresh client per call, less the bytes of a connection that
only asks for ModelInfo. Rows: the pipeline's I2V input (an image as the float32 frames its
VideoProcessor makes, which travel as their uint8 values, then zeros), a random-float image in
float32 and bfloat16 (one frame sent, the zeros as `trailing_zero_frames`), the same with
`send_zeros=True`, and uint8 frames of the whole video
(97 MB: uint8 0 is -1.0, so no frame of it is a zero frame).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading

import torch

from vaed_process import start_vaed


class CountingProxy:
    """Loopback TCP proxy on its own thread; `up` / `down`: bytes client->server / server->client."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.up = self.down = 0
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, daemon=True).start()
        server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._handle, "127.0.0.1", 0), self._loop)
        self.port = server.result(10).sockets[0].getsockname()[1]

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upward: bool) -> None:
            try:
                while data := await reader.read(1 << 20):
                    if upward:
                        self.up += len(data)
                    else:
                        self.down += len(data)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pump(client_r, server_w, True), pump(server_r, client_w, False))

    def measure(self, call: object) -> tuple[int, int]:
        """(up, down) bytes of one connection running `call(client)`."""
        from vaed_client import VaeClient

        before = (self.up, self.down)
        with VaeClient(f"127.0.0.1:{self.port}", timeout=600) as client:
            call(client)  # type: ignore[operator]
        # a closed connection's last bytes are counted once the proxy forwarded them
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0.2), self._loop).result(10)
        return self.up - before[0], self.down - before[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:wan2.1-tiny")
    parser.add_argument("--gpu", default=None, help="GPU index (default: the CPU)")
    parser.add_argument("--size", default="480x832x81", help="HxWxT of the I2V video")
    parser.add_argument("--rows", type=int, default=None, help="only the first N rows")
    args = parser.parse_args()
    h, w, t = (int(v) for v in args.size.split("x"))
    device = ["--device", "cpu"] if args.gpu is None else []
    proc, target, _ = start_vaed(args.model, args.gpu, [*device, "--encode", "--warmup-shapes", "none"])
    try:
        proxy = CountingProxy(int(target.rsplit(":", 1)[1]))
        base_up, base_down = proxy.measure(lambda c: c.model_info())
        image = torch.rand(1, 3, 1, h, w, generator=torch.Generator().manual_seed(0)) * 2 - 1
        i2v = torch.cat([image, torch.zeros(1, 3, t - 1, h, w)], dim=2)
        # what WanImageToVideoPipeline hands vae.encode: a uint8 image as u / 255 * 2 - 1, then zeros
        pil_like = (torch.randint(0, 256, (1, 3, 1, h, w), generator=torch.Generator().manual_seed(1),
                                  dtype=torch.uint8).to(torch.float32) / 255.0) * 2.0 - 1.0
        pipeline_i2v = torch.cat([pil_like, torch.zeros(1, 3, t - 1, h, w)], dim=2)
        rows = [
            ("I2V of an image, float32 (as uint8)", lambda c: c.encode(pipeline_i2v)),
            ("I2V float32, zeros as a count", lambda c: c.encode(i2v)),
            ("I2V bfloat16, zeros as a count", lambda c: c.encode(i2v.to(torch.bfloat16))),
            ("I2V bfloat16, send_zeros=True", lambda c: c.encode(i2v.to(torch.bfloat16), send_zeros=True)),
            ("uint8 frames of the whole video", lambda c: c.encode(
                ((i2v + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 4, 1).contiguous())),
        ]
        print(f"{args.model} {h}x{w}x{t}: bytes on the wire per Encode call (ModelInfo's connection subtracted: "
              f"{base_up} up, {base_down} down)")
        for name, call in rows[: args.rows]:
            up, down = proxy.measure(lambda c, call=call: (c.model_info(), call(c)))
            print(f"  {name:<34} up {up - base_up:>12,d} B ({(up - base_up) / 1e6:8.2f} MB)   "
                  f"down {down - base_down:>10,d} B", flush=True)
    finally:
        proc.terminate()
        proc.communicate(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
