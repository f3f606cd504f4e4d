"""Can the lossless tier cut a first chunk's causal convs to their last time tap, bit for bit?

A video's first latent frame decodes with no cache: every WanCausalConv3d pads the one frame
with two zero frames in front, so two of its three time taps multiply zeros. The fast tier
already runs those convs as one conv2d over the last tap (a third of the work; frame 0 is
what a client waits for first). The lossless tier keeps stock's conv3d there, because another
kernel may sum in another order. This measures whether it must: for every such conv of stock's
own first-chunk decode (channels_last_3d, bias left out: torch adds a cuDNN conv's bias in a
pass of its own), on the real activations it was called with, it compares stock's conv3d
output bitwise (int16 views, so -0 and +0 differ) with

* ``conv2d``: F.conv2d over the real frame and the last tap's weight (channels-last);
* ``conv3d-1tap``: F.conv3d over the real frame alone and the last tap as a 1 x kh x kw kernel;
* with ``--plans``, every cuDNN-frontend execution plan of that conv2d (all heuristics' plans
  built, as ``bench_convs.py`` builds them).

and times each (``conv_plans.gpu_ms``: GPU time of single launches). Per conv it prints the
mismatching elements of each candidate, its ms against stock's, and the fastest bit-exact
plan; then the first chunk's totals: stock's conv ms, the fastest bit-exact candidate's where
every conv has one.

Run on the GPU machine from the repository root:
    python benchmarks/first_chunk_taps.py --model wan2.1 --size 480,832
    python benchmarks/first_chunk_taps.py --model wan2.2 --size 704,1280 --plans
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_convs import (  # noqa: E402
    Frontend,
    StepError,
    build_graph,
    error_text,
    plan_count,
    run_plan,
    signature_of,
    wrapped_convs,
)

from vaed.patches.conv_plans import gpu_ms  # noqa: E402

ConvFn = Callable[..., torch.Tensor]


@dataclass
class Candidate:
    name: str
    ms: float | None = None
    mismatches: int | None = None  # output elements whose bits differ from stock's
    error: str | None = None

    @property
    def exact(self) -> bool:
        return self.mismatches == 0


@dataclass
class ConvRow:
    label: str
    elements: int
    stock_ms: float
    candidates: list[Candidate] = field(default_factory=list)

    def fastest_exact(self) -> Candidate | None:
        exact = [c for c in self.candidates if c.exact and c.ms is not None]
        return min(exact, key=lambda c: c.ms or math.inf) if exact else None


def bit_mismatches(got: torch.Tensor, want: torch.Tensor) -> int:
    """Elements whose bit patterns differ (a bf16 / fp16 view as int16, so -0 != +0)."""
    if got.shape != want.shape:
        raise ValueError(f"shapes differ: {tuple(got.shape)} vs {tuple(want.shape)}")
    view = torch.int16 if got.element_size() == 2 else torch.int32
    return int((got.contiguous().view(view) != want.contiguous().view(view)).sum())


def is_first_chunk_causal(x: torch.Tensor, w: torch.Tensor) -> bool:
    """A causal 3-tap conv over one frame behind two zero frames: what a first chunk calls."""
    return w.dim() == 5 and w.shape[2] == 3 and x.shape[2] == 3 and not bool(x[:, :, :2].any())


def last_tap_inputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the real frame [B, C, H, W], the last tap [Co, C, kh, kw]), both channels-last."""
    x2 = x[:, :, 2]
    if not x2.is_contiguous(memory_format=torch.channels_last):
        x2 = x2.contiguous(memory_format=torch.channels_last)
    return x2, w[:, :, 2].contiguous(memory_format=torch.channels_last)


def run_candidate(name: str, fn: Callable[[], torch.Tensor], want: torch.Tensor, iters: int) -> Candidate:
    c = Candidate(name)
    try:
        got = fn()
        c.mismatches = bit_mismatches(got.reshape(want.shape), want)
        c.ms = gpu_ms(fn, iters)
    except Exception as exc:  # noqa: BLE001 - a refusal is a result here
        c.error = error_text(exc)
    return c


def plan_candidates(fe: Frontend, x2: torch.Tensor, w2: torch.Tensor, want: torch.Tensor,
                    iters: int) -> list[Candidate]:
    """Every frontend plan of the last-tap conv2d, each checked bitwise and timed."""
    sig = signature_of("conv2d", (x2, w2), {})
    y = torch.empty_like(F.conv2d(x2, w2), memory_format=torch.channels_last)
    try:
        graph, pack, _ = build_graph(fe, sig, x2, w2, y)
    except StepError as exc:
        return [Candidate("plans", error=str(exc))]
    out = []
    for i in range(plan_count(graph)):
        # bench_convs' own execute-check-time step; y then holds the plan's output
        run = run_plan(fe, graph, pack, y, want[:, :, 0], i, iters)
        c = Candidate(f"plan{i} {run.name}", ms=run.ms, error=run.error)
        if run.error is None:
            c.mismatches = bit_mismatches(y.reshape(want.shape), want)
        out.append(c)
    return out


def probe_conv(x: torch.Tensor, w: torch.Tensor, original: ConvFn, fe: Frontend | None, iters: int) -> ConvRow:
    want = original(x, w)
    x2, w2 = last_tap_inputs(x, w)
    w3 = w[:, :, 2:].contiguous(memory_format=torch.channels_last_3d)
    x3 = x[:, :, 2:]
    label = f"{w.shape[1]:4d}->{w.shape[0]:<4d} k{w.shape[3]}x{w.shape[4]} at {x.shape[3]}x{x.shape[4]}"
    row = ConvRow(label, want.numel(), gpu_ms(lambda: original(x, w), iters))
    row.candidates.append(run_candidate("conv2d", lambda: F.conv2d(x2, w2), want, iters))
    row.candidates.append(run_candidate("conv3d-1tap", lambda: original(x3, w3), want, iters))
    if fe is not None:
        row.candidates.extend(plan_candidates(fe, x2, w2, want, iters))
    return row


def collect(vae: Any, z: torch.Tensor, fe: Frontend | None, iters: int) -> list[ConvRow]:
    """Stock's decode of z's first latent frame, each first-chunk causal conv probed as called."""
    rows: list[ConvRow] = []

    def wrap(kind: str, original: ConvFn) -> ConvFn:
        def conv(*args: Any, **kwargs: Any) -> torch.Tensor:
            if kind == "conv3d":
                sig = signature_of(kind, args, kwargs)
                x, w = args[0], args[1]
                plain = sig.stride == sig.dilation == (1, 1, 1) and sig.padding == (0, 0, 0) and sig.groups == 1
                if plain and is_first_chunk_causal(x, w):
                    rows.append(probe_conv(x, w, original, fe, iters))
            return original(*args, **kwargs)

        return conv

    with torch.inference_mode(), wrapped_convs(wrap):
        vae.decode(z[:, :, :1], return_dict=False)
    return rows


def report(rows: list[ConvRow]) -> None:
    print(f"{'#':>2s}  {'conv':28s} {'stock ms':>8s} | {'conv2d ms':>9s} {'mism':>9s} | {'1tap ms':>8s} "
          f"{'mism':>9s} | {'exact plans':>11s} {'best exact':>10s}  best exact plan")
    for k, r in enumerate(rows):
        by = {c.name: c for c in r.candidates}
        plans = [c for c in r.candidates if c.name.startswith("plan")]
        exact_plans = [c for c in plans if c.exact]
        best = r.fastest_exact()

        def cols(c: Candidate | None) -> str:
            if c is None or c.error:
                return f"{'-':>8s} {'err' if c else '-':>9s}"
            return f"{c.ms:8.3f} {c.mismatches:>9d}"

        print(f"{k:2d}  {r.label:28s} {r.stock_ms:8.3f} | {cols(by.get('conv2d')):>19s} | "
              f"{cols(by.get('conv3d-1tap'))} | {len(exact_plans):>4d}/{len(plans):<6d} "
              f"{(best.ms if best and best.ms else math.nan):10.3f}  {best.name if best else '-'}", flush=True)
        for c in r.candidates:
            if c.error and not c.name.startswith("plan"):
                print(f"      {c.name}: {c.error}")
    stock = sum(r.stock_ms for r in rows)
    bests = [r.fastest_exact() for r in rows]
    exact = sum(b.ms or 0.0 for b in bests if b)
    covered = sum(b is not None for b in bests)
    print(f"first chunk: {len(rows)} causal convs, stock {stock:.3f} ms; bit-exact last-tap candidate for "
          f"{covered}/{len(rows)}" + (f", fastest exact {exact:.3f} ms ({stock - exact:+.3f} ms saved)"
                                      if covered == len(rows) else ""), flush=True)
    for name in ("conv2d", "conv3d-1tap"):
        cs = [next(c for c in r.candidates if c.name == name) for r in rows]
        n_exact = sum(c.exact for c in cs)
        total = sum(c.ms or 0.0 for c in cs)
        print(f"  {name}: exact on {n_exact}/{len(rows)} convs, {total:.3f} ms in all", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wan2.1", help="random architecture: wan2.1 or wan2.2")
    parser.add_argument("--size", default="480,832", help="H,W of the video")
    parser.add_argument("--plans", action="store_true", help="also every cuDNN-frontend plan of the conv2d")
    parser.add_argument("--heuristics", default="A,B,FALLBACK")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA", file=sys.stderr)
        return 2
    from vaed.choices import Kernels, Layout
    from vaed.models import build_random_vae
    from vaed.patches import prepare_decoder, to_decoder_layout

    vae = build_random_vae(args.model).to("cuda", torch.bfloat16).eval().requires_grad_(False)
    prepare_decoder(vae, kernels=Kernels.OFF, layout=Layout.CHANNELS_LAST)
    h, w = (int(v) for v in args.size.split(","))
    cfg = vae.config
    ss = int(cfg.scale_factor_spatial or 8)
    g = torch.Generator().manual_seed(args.seed)
    z = torch.randn(1, int(cfg.z_dim), 1, h // ss, w // ss, generator=g).to("cuda", torch.bfloat16)
    z = to_decoder_layout(z, Layout.CHANNELS_LAST)
    fe = Frontend.open(args.heuristics) if args.plans else None
    if fe is not None:
        print("cuDNN frontend", fe.versions(), flush=True)
    print(f"{args.model} {h}x{w}, first chunk, stock channels_last_3d, cuDNN {torch.backends.cudnn.version()}",
          flush=True)
    report(collect(vae, z, fe, args.iters))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
