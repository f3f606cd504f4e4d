"""GPU failover check: a 480x832x81 decode whose server is killed (kill -9) after half its
frames finishes on a second server, bit-identical to an undisturbed decode.

Two `vaed serve` processes (A and B, on --gpu and --gpu-b; the same GPU by default: an H200
holds two copies of the Wan VAE easily). For each way of calling (`stream`, a DecodeStream
of the whole latents, and `session`, latents pushed one latent frame per message):

1. B decodes the latents undisturbed: the reference.
2. A client with targets [A, B] starts the same call on A; once it holds half the frames
   (41 of 81) it kills A with SIGKILL. The client resumes on B with skip_frames=41; B decodes
   all 21 latent frames again and sends frames 41..80.
3. Every frame must arrive once, in order, and the video must equal the reference
   (torch.equal); the resume count, the reasons and the recovery time (kill -> first frame
   from B, the re-decode of the skipped frames included) are printed. A is started again
   for the next way.

    python benchmarks/failover_gpu.py --model random:wan2.1 --gpu 0
    python benchmarks/failover_gpu.py --model random:wan2.1 --gpu 0 --precision fast
    python benchmarks/failover_gpu.py --model random:wan2.1 --gpu 0 --gpu-b 1   # two GPUs
    python benchmarks/failover_gpu.py --model random:wan2.1-tiny --gpu cpu --shape 1,4,21,8,8  # a CPU try

Exit code 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Any, Iterator

import torch

from vaed_client import CallReport, VaeClient, assemble
from vaed_process import start_vaed


def serve(args: argparse.Namespace, gpu: str) -> tuple[subprocess.Popen, str]:
    """`vaed serve` on `gpu` ("cpu": on the CPU, to try this script with a tiny model), warmed up
    for the frame size of --shape."""
    _, _, _, h, w = (int(d) for d in args.shape.split(","))
    extra = ["--warmup-shapes", f"{h * 8}x{w * 8}"]
    if args.precision:
        extra += ["--precision", args.precision]
    if gpu == "cpu":
        return start_vaed(args.model, None, ["--device", "cpu", *extra])[:2]
    return start_vaed(args.model, gpu, extra)[:2]


def chunks_of(client: VaeClient, way: str, latents: torch.Tensor, report: CallReport,
              half: int, kill: Any) -> Iterator[Any]:
    """The call's chunks; `kill()` runs once `half` frames are in. A session pushes only the
    latent frames of the first half before that, so A cannot have finished when it dies."""
    if way == "stream":
        for chunk in client.stream(latents, report=report):
            yield chunk
            if chunk.end_frame >= half:
                kill()
        return
    head = -(-(half - 1) // 4) + 1  # latent frames that decode to >= `half` frames (1, then 4 per latent frame)
    with client.session(report=report) as session:
        for t in range(head):
            session.push(latents[:, :, t : t + 1])
        for chunk in session:
            yield chunk
            if chunk.end_frame >= half:
                break
        kill()
        for t in range(head, latents.shape[2]):
            session.push(latents[:, :, t : t + 1])
        session.close()
        yield from session


def check(args: argparse.Namespace, way: str, latents: torch.Tensor, target_b: str) -> bool:
    with VaeClient(target_b) as client:
        want = client.decode(latents)
    frames = want.shape[1]
    proc_a, target_a = serve(args, args.gpu)
    report = CallReport()
    chunks: list[Any] = []
    killed_after: list[int] = []

    def kill() -> None:
        if not killed_after:
            proc_a.kill()  # SIGKILL: no drain, no goodbye
            killed_after.append(chunks[-1].end_frame)

    try:
        with VaeClient([target_a, target_b]) as client:
            for chunk in chunks_of(client, way, latents, report, frames // 2, kill):
                chunks.append(chunk)
    finally:
        proc_a.kill()
        proc_a.communicate(timeout=60)
    got = assemble(chunks)
    covered = [f for c in chunks for f in range(c.first_frame, c.end_frame)]
    once = covered == list(range(frames))
    equal = torch.equal(got, want)
    recovery = ", ".join(f"{s * 1e3:.0f} ms" for s in report.recovery_seconds) or "-"
    print(f"{way}: killed A after {killed_after[0] if killed_after else '-'} of {frames} frames; "
          f"resumes={report.resumes} targets={report.targets} recovery={recovery}")
    if report.resumes == 0:
        print(f"{way}: A had sent every frame before it died (no resume to check)")
    print(f"{way}: every frame once and in order: {once}; bit-identical to the undisturbed decode: {equal}; "
          f"reasons={report.reasons}")
    return once and equal and report.resumes == 1 and report.targets == [target_a, target_b]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:wan2.1")
    parser.add_argument("--gpu", default="0", help="server A's GPU (default 0; cpu: the CPU)")
    parser.add_argument("--gpu-b", help="server B's GPU (default: --gpu)")
    parser.add_argument("--precision", choices=["lossless", "fast"], help="both servers' --precision")
    parser.add_argument("--shape", default="1,16,21,60,104", help="latents B,z,T,h,w (default 480x832x81)")
    args = parser.parse_args()
    shape = tuple(int(d) for d in args.shape.split(","))
    latents = torch.randn(*shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    proc_b, target_b = serve(args, args.gpu_b or args.gpu)
    try:
        results = [check(args, way, latents, target_b) for way in ("stream", "session")]
    finally:
        proc_b.terminate()
        out, _ = proc_b.communicate(timeout=120)
    skipped = [line for line in out.splitlines() if "skipped_frames=" in line]
    print("server B's resumed calls:", *skipped, sep="\n  ")
    print("PASS" if all(results) else "FAIL")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
