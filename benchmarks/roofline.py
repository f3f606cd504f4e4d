"""Where a steady chunk's GPU time goes, against the GPU's limits: a roofline by op.

For each case and tier, one steady decoder chunk (latent frame 4, its cache from frames 0-3)
runs with every op of the tier's op set (``vaed.patches.ops.OP_NAMES`` and the attention hook)
between two CUDA events of its own. Per op and shape, one row:

* ``calls`` and ``ms``: the GPU time between each call's events: the op's kernels where the host
  is ahead of the GPU, and the GPU's waits for the host too where it is not (a steady 480x832
  fast chunk spanned 37.8 ms against its kernels' 31.7 on an H200);
* ``share``: of the chunk's GPU time (its first op's start to its last op's end);
* ``GB`` and ``GB/s``: each call's tensor operands read once and its new results written once
  (the conv weights included; a result that is a view of an operand is not written), the least
  any implementation of the op moves, over its time;
* ``TFLOP`` and ``TFLOP/s`` (convs): 2 x output elements x input channels per group x kernel
  volume;
* ``%peak``: the larger of the two rates against the device's dense bf16 tensor rate or its
  HBM rate (``PEAKS``; blank for a device not listed).

An op called inside another (a fallback through an op set's own ops) counts in the outer one.
``outside the ops`` is the chunk's GPU time between ops: the decoder's own aten calls (the
lossless tier's norm reductions and conv1 bias passes among them). torch.profiler's ranges were
tried first: they do not hold the Triton kernels launched inside them.

Run on the GPU machine from the repository root:
    python benchmarks/roofline.py                                   # all cases, both tiers
    python benchmarks/roofline.py --cases wan2.2-704p --tiers lossless --top 20
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vaed import patches as P
from vaed.models import load_model
from vaed.patches.ops import OP_NAMES, OpSet

sys.path.insert(0, str(Path(__file__).resolve().parent))

from profile_fast import CASES, DEFAULT_CASES, decode, latent_shape

# (dense bf16 tensor FLOP/s, HBM bytes/s), by a substring of torch.cuda.get_device_name(); the
# vendors' datasheet figures (H100 SXM and H200 share the compute, not the memory)
PEAKS: dict[str, tuple[float, float]] = {
    "H200": (989e12, 4.8e12),
    "H100 80GB HBM3": (989e12, 3.35e12),
    "H100 PCIe": (756e12, 2.0e12),
    "A100-SXM4-80GB": (312e12, 2.04e12),
}
STEADY_FRAME = 4  # as profile_fast.profile_chunk: the cache holds frames 0-3


def peaks_of(device_name: str) -> tuple[float, float] | None:
    for key, peaks in PEAKS.items():
        if key in device_name:
            return peaks
    return None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)


def tensor_bytes(value: Any, skip: frozenset[int] = frozenset()) -> int:
    """Bytes of every tensor in ``value`` (a tensor, or tuples/lists of them; others count 0)
    whose storage is not in ``skip`` (storage addresses)."""
    return sum(t.numel() * t.element_size() for t in _tensors(value)
               if t.untyped_storage().data_ptr() not in skip)


def _storages(value: Any) -> frozenset[int]:
    return frozenset(t.untyped_storage().data_ptr() for t in _tensors(value))


def conv_flops(weight: torch.Tensor, groups: int, out: torch.Tensor) -> int:
    """2 x multiply-adds of a conv of ``weight`` ([C_out, C_in/groups, *kernel]) giving ``out``."""
    del groups  # the weight's second dim is already per group
    return 2 * out.numel() * math.prod(weight.shape[1:])


def _spatial(t: torch.Tensor) -> str:
    return "x".join(str(s) for s in t.shape[2:])


def op_key(name: str, args: tuple[Any, ...], out: Any) -> str:
    """A row's label: the op, and for a conv its channels, kernel and output size; for the
    others the first tensor operand's channels and size."""
    first = args[0] if args else None
    if isinstance(first, torch.nn.Module) and isinstance(getattr(first, "weight", None), torch.Tensor):
        w = first.weight
        y = next(_tensors(out), None)
        kernel = "x".join(str(k) for k in w.shape[2:])
        size = _spatial(y) if y is not None else "?"
        return f"{name} {w.shape[1] * first.groups}->{w.shape[0]} k{kernel} @{size}"
    x = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return name if x is None or x.dim() < 3 else f"{name} C{x.shape[1]} @{_spatial(x)}"


def call_cost(args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> tuple[int, int]:
    """(bytes, FLOPs) of one op call: its tensor operands (a conv module's weight, and its bias
    where the call adds it) read once, its results written once (not one that is a view of an
    operand, as a next cache cut from the input is); FLOPs for a conv."""
    inputs = [*args, *kwargs.values()]
    moved = tensor_bytes(inputs) + tensor_bytes(out, skip=_storages(inputs))
    first = args[0] if args else None
    weight = getattr(first, "weight", None) if isinstance(first, torch.nn.Module) else None
    if not isinstance(weight, torch.Tensor):
        return moved, 0
    moved += tensor_bytes(weight)
    if kwargs.get("bias", True) and isinstance(getattr(first, "bias", None), torch.Tensor):
        moved += tensor_bytes(first.bias)
    y = next(_tensors(out), None)
    return moved, (conv_flops(weight, first.groups, y) if y is not None else 0)


@dataclass
class OpRow:
    key: str
    calls: int = 0
    bytes: int = 0
    flops: int = 0
    seconds: float = 0.0


class Recorder:
    """Wraps an op set's ops: each outermost call runs between two CUDA events (host clock on a
    CPU), and its row key, bytes and FLOPs are kept with them."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.calls: list[tuple[str, int, int, Any, Any]] = []  # (key, bytes, FLOPs, start, end)
        self._depth = threading.local()

    def mark(self) -> Any:
        """A point in the chunk's GPU time (a recorded CUDA event), or the host clock's."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def wrap(self, name: str, op: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._depth, "inside", False):
                return op(*args, **kwargs)
            self._depth.inside = True
            try:
                start = self.mark()
                out = op(*args, **kwargs)
                end = self.mark()
            finally:
                self._depth.inside = False
            if out is None:  # declined: the caller's other path is recorded on its own
                self.calls.append((f"{name} (declined)", 0, 0, start, end))
            else:
                self.calls.append((op_key(name, args, out), *call_cost(args, kwargs, out), start, end))
            return out

        return recorded

    def instrument(self, ops: OpSet) -> OpSet:
        """``ops`` with every switchable op and the attention hook recorded."""
        wrapped = {n: self.wrap(n, getattr(ops, n)) for n in OP_NAMES}
        wrapped["attention"] = self.wrap("attention", ops.attention)
        return dataclasses.replace(ops, **wrapped)

    def seconds(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


def rows_from(calls: list[tuple[str, int, int, float]]) -> list[OpRow]:
    """Per key: calls, bytes, FLOPs and seconds, the slowest first."""
    rows: dict[str, OpRow] = {}
    for key, moved, flops, secs in calls:
        row = rows.setdefault(key, OpRow(key))
        row.calls += 1
        row.bytes += moved
        row.flops += flops
        row.seconds += secs
    return sorted(rows.values(), key=lambda r: -r.seconds)


@torch.inference_mode()
def profile_steady_chunk(vae: Any, z: torch.Tensor, ops: OpSet) -> tuple[list[OpRow], float]:
    """(rows, the chunk's GPU seconds) of latent frame STEADY_FRAME decoded after the others."""
    k = min(STEADY_FRAME, z.shape[2] - 1)
    _, cache = decode(vae, z[:, :, :k], ops)
    x = vae.post_quant_conv(z[:, :, k:k + 1])
    recorder = Recorder(z.is_cuda)
    traced = recorder.instrument(ops)

    def chunk() -> tuple[Any, Any]:
        with P.using(traced):
            start = recorder.mark()
            vae.decoder(x, feat_cache=list(cache), feat_idx=[0], first_chunk=False)
            return start, recorder.mark()

    chunk()  # first use of anything this path adds (the wrappers launch nothing of their own)
    recorder.calls.clear()
    if z.is_cuda:
        torch.cuda.synchronize()
    start, end = chunk()
    if z.is_cuda:
        torch.cuda.synchronize()
    calls = [(key, moved, flops, recorder.seconds(a, b)) for key, moved, flops, a, b in recorder.calls]
    return rows_from(calls), recorder.seconds(start, end)


def _rate(amount: float, seconds: float, unit: float) -> str:
    return f"{amount / seconds / unit:8.1f}" if seconds > 0 else f"{'-':>8}"


def report(label: str, rows: list[OpRow], total: float, peaks: tuple[float, float] | None, top: int) -> dict[str, Any]:
    """Print the table of one chunk; returns it as JSON-ready data."""
    inside = sum(r.seconds for r in rows)
    print(f"\n--- {label}: one steady chunk, {total * 1e3:.2f} ms of GPU time; "
          f"{inside * 1e3:.2f} ms inside the ops, {(total - inside) * 1e3:.2f} ms outside them")
    print(f"{'op and shape':52s} {'calls':>5s} {'ms':>8s} {'share':>6s} {'GB':>7s} {'GB/s':>8s} "
          f"{'TFLOP':>7s} {'TFLOP/s':>8s} {'%peak':>6s}")
    out_rows = []
    for r in rows:
        pct = ""
        if peaks is not None and r.seconds > 0:
            pct = f"{100 * max(r.flops / r.seconds / peaks[0], r.bytes / r.seconds / peaks[1]):5.0f}%"
        if len(out_rows) < top:
            share = 100 * r.seconds / total if total else 0.0
            print(f"{r.key[:52]:52s} {r.calls:5d} {r.seconds * 1e3:8.3f} {share:5.1f}% "
                  f"{r.bytes / 1e9:7.3f} {_rate(r.bytes, r.seconds, 1e9)} {r.flops / 1e12:7.3f} "
                  f"{_rate(r.flops, r.seconds, 1e12) if r.flops else f'{chr(45):>8}'} {pct:>6s}")
        out_rows.append(dataclasses.asdict(r))
    by_op: dict[str, list[float]] = {}
    for r in rows:
        op = r.key.split(" ")[0]
        acc = by_op.setdefault(op, [0.0, 0.0, 0.0])
        acc[0] += r.seconds
        acc[1] += r.bytes
        acc[2] += r.flops
    print("by op: " + "; ".join(
        f"{op} {s * 1e3:.2f} ms ({100 * s / total if total else 0:.0f} %"
        + (f", {f / s / 1e12:.0f} TFLOP/s" if f and s else f", {b / s / 1e9:.0f} GB/s" if s else "") + ")"
        for op, (s, b, f) in sorted(by_op.items(), key=lambda kv: -kv[1][0])))
    return {"label": label, "chunk_ms": total * 1e3, "inside_ms": inside * 1e3, "rows": out_rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(CASES))
    parser.add_argument("--tiers", nargs="+", default=["lossless", "fast"], choices=["lossless", "fast"])
    parser.add_argument("--device", default="cuda:0",
                        help="cpu only for a smoke test under TRITON_INTERPRET=1 (no GPU times)")
    parser.add_argument("--top", type=int, default=25, help="rows printed per chunk (the JSON has all)")
    parser.add_argument("--json", metavar="PATH", help="write every chunk's rows here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    peaks = peaks_of(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if device.type == "cuda":
        print(f"device: {torch.cuda.get_device_name(device)}; peaks "
              + ("unknown" if peaks is None else f"{peaks[0] / 1e12:.0f} TFLOP/s bf16, {peaks[1] / 1e12:.2f} TB/s"))
    results = []
    for name in args.cases:
        spec, (frames, height, width) = CASES[name]
        vae = load_model(spec, device, torch.bfloat16, decoder_only=True).vae
        rep = P.prepare_decoder(vae, kernels="triton",
                                layout="channels_last", tiers=tuple(args.tiers))
        g = torch.Generator(device=device).manual_seed(0)
        z = torch.randn(latent_shape(vae, frames, height, width), generator=g, device=device)
        z = P.to_decoder_layout(z.to(torch.bfloat16), "channels_last")
        for tier in args.tiers:
            rows, total = profile_steady_chunk(vae, z, rep.ops_for(tier))
            results.append(report(f"{name} {tier} ({height}x{width})", rows, total, peaks, args.top))
        del vae, z
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
