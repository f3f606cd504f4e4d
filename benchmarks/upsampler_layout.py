"""Could the lossless tier run the upsamplers' image conv channels-last, as the fast tier does?

Stock's `upsample3d` interleaves the time_conv's two channel blocks into frames, which leaves
its images NCHW, so its 3x3 conv2d runs NCHW (a 4-D weight the decoder's layout leaves as it
is) and the next block reads NTCHW activations. Three questions, on stock diffusers with
channels_last_3d Conv3d weights (the lossless tier's reference):

1. ``relaid``: a decode whose upsample3d conv outputs are only re-laid NHWC (same values): are
   its frames still stock's bits? (What reads them next, the norm's reduction among them, may
   sum in another order on another layout.)
2. ``torch NHWC``: torch's conv2d on the NHWC input and weight: the NCHW conv's values? time?
3. ``plans`` (CUDA with the cuDNN frontend): every plan of the NHWC conv, checked against the
   NCHW conv's values; how many match, and the fastest of those.

Run on the GPU machine from the repository root (the frontend: ``pip install
nvidia-cudnn-frontend``):
    python benchmarks/upsampler_layout.py                      # Wan2.2 704x1280, Wan2.1 480x832
    python benchmarks/upsampler_layout.py --cases wan2.1-tiny:8x8 --device cpu   # a smoke run
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from vaed.choices import Kernels, Layout
from vaed.models import build_random_vae
from vaed.patches import conv_plans as cp
from vaed.patches import prepare_decoder, to_decoder_layout

DEFAULT_CASES = ("wan2.2:44x80", "wan2.1:60x104")
LATENT_FRAMES = 3  # frame 2 is a steady chunk, where both upsample3d convs interleave


def upsample3d_convs(vae: Any) -> list[torch.nn.Conv2d]:
    return [m.resample[1] for m in vae.decoder.modules()
            if type(m).__name__ == "WanResample" and m.mode == "upsample3d"]


@contextmanager
def relaid_nhwc(convs: list[torch.nn.Conv2d]) -> Iterator[None]:
    """The convs' outputs re-laid channels-last: the same values in another layout."""
    hooks = [c.register_forward_hook(lambda m, i, o: o.contiguous(memory_format=torch.channels_last)) for c in convs]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


ConvInput = tuple[torch.nn.Conv2d, torch.Size, tuple[int, ...]]  # the conv, its input's shape and strides


def conv_inputs(vae: Any, z: torch.Tensor, convs: list[torch.nn.Conv2d]) -> list[ConvInput]:
    """Each upsample3d conv's input shapes and strides in a decode of ``z``, once per shape."""
    seen: dict[tuple[int, torch.Size], ConvInput] = {}

    def note(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
        x = inputs[0]
        seen.setdefault((id(module), x.shape), (module, x.shape, x.stride()))  # type: ignore[arg-type]

    hooks = [c.register_forward_pre_hook(note) for c in convs]
    try:
        vae.decode(z, return_dict=False)
    finally:
        for h in hooks:
            h.remove()
    return list(seen.values())


def relaid_is_stock(vae: Any, z: torch.Tensor, convs: list[torch.nn.Conv2d]) -> tuple[bool, float]:
    """(bit-identical, max |difference|) of a decode with the convs' outputs re-laid NHWC."""
    want = vae.decode(z, return_dict=False)[0]
    with relaid_nhwc(convs):
        got = vae.decode(z, return_dict=False)[0]
    return torch.equal(got, want), (got.float() - want.float()).abs().max().item()


def nhwc_plans(x: torch.Tensor, w: torch.Tensor, want: torch.Tensor) -> tuple[int, int, list[tuple[float, str]]]:
    """(plans, plans giving ``want``'s values, [(ms, name)] of those, fastest first) of the cuDNN
    frontend's NHWC conv of ``x`` and ``w`` (both channels-last)."""
    planner = cp.ConvPlanner.open(x.device, None, exact=True)
    if isinstance(planner, str):
        raise RuntimeError(planner)
    call = cp.ConvCall.of(x, w, 1, 1, 1, 1)
    assert call is not None
    y_stride = want.contiguous(memory_format=torch.channels_last).stride()
    g = cp._build_graph(planner._cudnn, planner._handle, call, y_stride)
    g.graph.create_execution_plans([planner._cudnn.heur_mode.A, planner._cudnn.heur_mode.FALLBACK])
    count = int(g.graph.get_execution_plan_count())
    exact: list[tuple[float, str]] = []
    for i in range(count):
        try:
            g.graph.build_plan_at_index(i)
            g.workspace = int(g.graph.get_workspace_size_plan_at_index(i))
            if torch.equal(planner._execute(g, x, w, i), want):
                ms = cp.gpu_ms(lambda i=i: planner._execute(g, x, w, i))
                exact.append((ms, str(g.graph.get_plan_name_at_index(i))))
        except Exception:  # a plan that does not build or run is no candidate
            continue
    return count, len(exact), sorted(exact)


@torch.inference_mode()
def run_case(arch: str, lh: int, lw: int, device: torch.device, plans: bool) -> None:
    vae = build_random_vae(arch).to(device, torch.bfloat16).eval()
    prepare_decoder(vae, kernels=Kernels.OFF, layout=Layout.CHANNELS_LAST)
    convs = upsample3d_convs(vae)
    print(f"== {arch}, latents {lh}x{lw}: {len(convs)} upsample3d convs", flush=True)
    for seed in (0, 1):
        g = torch.Generator(device="cpu").manual_seed(seed)
        z = torch.randn((1, vae.config.z_dim, LATENT_FRAMES, lh, lw), generator=g).to(device, torch.bfloat16)
        same, diff = relaid_is_stock(vae, to_decoder_layout(z, Layout.CHANNELS_LAST), convs)
        print(f"relaid, seed {seed}: bit-identical to stock {same} (max |diff| {diff:.3g})", flush=True)
    timed = device.type == "cuda"
    for conv, shape, stride in conv_inputs(vae, to_decoder_layout(z, Layout.CHANNELS_LAST), convs):
        x = torch.empty_strided(shape, stride, device=device, dtype=torch.bfloat16).normal_()
        w = conv.weight.detach()
        want = F.conv2d(x, w, None, 1, 1)
        xcl, wcl = x.contiguous(memory_format=torch.channels_last), w.contiguous(memory_format=torch.channels_last)
        same = torch.equal(F.conv2d(xcl, wcl, None, 1, 1), want)
        line = f"{list(shape)} -> {w.shape[0]} channels: torch NHWC gives the NCHW values: {same}"
        if timed:
            nchw = cp.gpu_ms(lambda x=x, w=w: F.conv2d(x, w, None, 1, 1))
            nhwc = cp.gpu_ms(lambda x=xcl, w=wcl: F.conv2d(x, w, None, 1, 1))
            line += f"; NCHW {nchw:.3f} ms, NHWC {nhwc:.3f} ms"
        print(line, flush=True)
        if plans and timed:
            count, exact, fastest = nhwc_plans(xcl, wcl, want)
            print(f"  plans: {exact} of {count} give the NCHW values; fastest {fastest[:2]}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), help="arch:HxW latent sizes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-plans", action="store_true", help="skip the cuDNN frontend's plans")
    args = parser.parse_args(argv)
    for case in args.cases:
        arch, size = case.split(":")
        lh, lw = (int(v) for v in size.split("x"))
        run_case(arch, lh, lw, torch.device(args.device), plans=not args.no_plans)
    return 0


if __name__ == "__main__":
    sys.exit(main())
