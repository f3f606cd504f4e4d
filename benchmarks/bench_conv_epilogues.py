"""Does a cuDNN graph with the residual epilogue fused into the conv beat conv + our residual kernel?

The fast tier runs a residual block's conv2 without its bias, and ``residual_add`` then computes
``x + bias + h`` in one Triton pass (``vaed.kernels.residual.bias_residual_add``, exact=False:
fp32 sum ``(x + bias) + h``, one rounding; ``x`` is the conv output already rounded to bf16, ``bias``
conv2's own in bf16 or, where the shortcut's pending bias joins it, an fp32 sum). The question is
whether cuDNN's runtime fusion engines do better with the epilogue in the conv: one graph
``conv_fprop -> bias -> add(residual)`` (fp32 intermediates, one bf16 rounding at the end) written
once, instead of a bf16 conv output written, read back and written again.

Which convs: the steady chunk (the last of ``--frames`` latent frames, as ``bench_convs.py``
records it) of the fast tier, decoded with the tier's ``residual_add`` wrapped. In
``residual_block`` the last conv before each residual add is conv2 (shortcut, conv1, conv2, add),
so an add whose ``x`` has the storage of the most recent ``F.conv2d``/``F.conv3d`` output IS
that conv2: its signature (a 3x3x3 conv3d, or the fast tier's unfolded conv2d over 3*C channels
at 96 channels), the add's shapes, the bias dtype reaching the add, and the calls per chunk are
exact. An add that does not match is counted and reported. ``--select square`` instead takes
every 3x3x3 conv3d with in = out channels and every 3x3 conv2d with in = 3 x out (unfolded)
from the plain conv recording: it also catches conv1s with in = out (over-counts calls) and
assumes a bf16 bias.

Per site, on fresh random tensors with the recorded shapes and strides (the residual ``h`` in
the conv output's layout, the kernel seeing it through the same 5-D view the fast tier makes),
one line: the site (the conv as bench_convs labels it, ``b:`` the bias dtype reaching the add),
``calls`` per steady chunk, then the milliseconds of

* ``conv``: (a) torch's conv without bias (``torch.backends.cudnn.benchmark`` as it is);
* ``plan``: the best plain-conv cuDNN-frontend plan (all plans of heuristics ``--heuristics``,
  as bench_convs times them; ``--skip-plain`` leaves it out);
* ``resid``: (b) the residual kernel alone, the fast tier's arguments;
* ``c``: (c) (a) then (b), back to back in one timed launch pair -- today's path without
  conv plans;
* ``c'``: the best plain plan then (b) -- today's path with ``--conv-plans``;
* ``fused``: (d) the best plan of the graph conv + bias + add(residual), every plan built, run,
  checked against (c)'s output (max |plan - c| / max |c| <= ``--max-err``) and timed;
  ``ok/n`` plans within --max-err / plans offered; ``err`` the best plan's error;
* ``cb``: (e) the best plan of the graph conv + bias alone (checked against torch's conv + bias
  in fp32, rounded once); ``cb+r``: that plan then the residual kernel without a bias (x + h);
* ``x c`` / ``x best``: (c) / fused and min(c, c') / fused (above 1: fusion is faster);
  ``beats``: fused < (c) (``yes``), or also < c' (``YES``); ``best fused plan``: its name.

A graph that fails to validate or build prints its error (shortened) under the site's line and
the site counts at (c)'s time. Summary: per-chunk totals (sum of ms x calls) of each column and
the projected saving per chunk and per ``--video-chunks`` (21) chunk video, against (c) and
against min(c, c'). Timing is ``vaed.patches.conv_plans.gpu_ms`` (median of ``--iters``
launches, each behind a GPU sleep, so host launch cost is hidden; L2 not flushed).

Run on the GPU machine from the repository root (needs ``pip install nvidia-cudnn-frontend``):
    python benchmarks/bench_conv_epilogues.py --model wan2.1
    python benchmarks/bench_conv_epilogues.py --model wan2.2 --latent 44,80 --json /tmp/epilogues.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vaed.kernels import _runtime as rt
from vaed.kernels.residual import bias_residual_add
from vaed.patches.conv_plans import gpu_ms

# bench_convs lives beside this script (sys.path[0] when run as one; not when imported by path)
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.append(_HERE)  # appended: its other scripts (profiling, load) shadow nothing
import bench_convs as bc  # noqa: E402

ConvSig = bc.ConvSig
SELECT_MODES = ("sites", "square")
C_PLAN = "c'"  # a column name with a quote, for the f-strings below
_SHORT_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}


# ---------------------------------------------------------------------------------------------
# Which convs: the conv2 sites of a steady chunk
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Conv2Site:
    """A residual block's conv2 and the residual add that reads its output."""

    sig: bc.ConvSig  # the conv, as torch was asked (bias left out by the fast tier)
    add_shape: tuple[int, ...]  # the add's x: 5-D (a conv2d output viewed as [B, C, T, H, W])
    add_stride: tuple[int, ...]
    h_stride: tuple[int, ...]  # the shortcut's strides as recorded (for --json; timed in x's layout)
    bias_dtype: str | None  # "torch.bfloat16" (conv2's own), "torch.float32" (summed), None (no bias)

    def label(self) -> str:
        return f"{self.sig.label()} b:{short_dtype(self.bias_dtype)}"


def short_dtype(dtype: str | None) -> str:
    return "-" if dtype is None else _SHORT_DTYPES.get(dtype, dtype.removeprefix("torch."))


class Conv2Tracker:
    """Remembers the storage of the last conv's output; a residual add whose x starts there is that
    conv's conv2 site (residual_block: shortcut, conv1, conv2, then the add). Counts only while
    ``active`` (the steady chunk)."""

    def __init__(self) -> None:
        self.active = False
        self.sites: dict[Conv2Site, int] = {}
        self.unmatched = 0  # residual adds whose x was not the last conv's output
        self._last: tuple[bc.ConvSig, int] | None = None

    @contextmanager
    def watching_convs(self) -> Iterator[None]:
        """Wrap F.conv2d / F.conv3d (module attributes: the fast tier's calls and Conv3d's alike)."""

        def wrap(kind: str, original: bc.ConvFn) -> bc.ConvFn:
            def conv(*args: Any, **kwargs: Any) -> torch.Tensor:
                out = original(*args, **kwargs)
                if self.active:
                    self._last = (bc.signature_of(kind, args, kwargs), out.data_ptr())
                return out

            return conv

        with bc.wrapped_convs(wrap):
            yield

    def note_add(self, x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None) -> None:
        last, self._last = self._last, None
        if last is None or x.data_ptr() != last[1]:
            self.unmatched += 1
            return
        site = Conv2Site(last[0], tuple(x.shape), tuple(x.stride()), tuple(h.stride()),
                         None if bias is None else str(bias.dtype))
        self.sites[site] = self.sites.get(site, 0) + 1

    def wrap_residual_add(self, op: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def residual_add(x: torch.Tensor, h: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            if self.active:
                self.note_add(x, h, bias)
            return op(x, h) if bias is None else op(x, h, bias)  # the call the tree made

        return residual_add


@torch.inference_mode()
def record_conv2_sites(vae: Any, z: torch.Tensor, ops: Any) -> tuple[dict[Conv2Site, int], int]:
    """(conv2 sites of the last latent frame with their calls, unmatched residual adds): the
    engine's loop of bench_convs.record_steady_chunk under ``ops`` with its residual_add wrapped."""
    from vaed import patches as P

    if z.shape[2] < 2:
        raise ValueError("need at least 2 latent frames: the last one must be a steady chunk")
    tracker = Conv2Tracker()
    traced = dataclasses.replace(ops, residual_add=tracker.wrap_residual_add(ops.residual_add))
    cache: list = [None] * bc.num_causal_convs(vae)
    x = vae.post_quant_conv(z)
    last = x.shape[2] - 1
    with P.using(traced), tracker.watching_convs():
        for i in range(last + 1):
            tracker.active = i == last
            vae.decoder(x[:, :, i : i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
    return tracker.sites, tracker.unmatched


def is_square_conv2(sig: bc.ConvSig) -> bool:
    """--select square: a plain 3x3x3 conv3d with in = out channels, or the fast tier's unfolded
    conv2d (3x3, in = 3 x out: the three time taps of a 3x3x3 in channels)."""
    plain = sig.groups == 1 and all(s == 1 for s in sig.stride) and all(d == 1 for d in sig.dilation)
    c_out, c_in = sig.w_shape[0], sig.w_shape[1]
    if sig.kind == "conv3d":
        return plain and sig.w_shape[2:] == (3, 3, 3) and c_in == c_out
    if sig.kind == "conv2d":
        return plain and sig.w_shape[2:] == (3, 3) and c_in == 3 * c_out
    return False


def square_sites(counts: dict[bc.ConvSig, int]) -> dict[Conv2Site, int]:
    """The --select square sites of a plain conv recording; the add's view and strides as the fast
    tier makes them (a conv2d's N frames are one batch's T), a bias in the conv's dtype."""
    out: dict[Conv2Site, int] = {}
    for sig, calls in counts.items():
        if not is_square_conv2(sig):
            continue
        out_spatial = sig.out_spatial()
        n, k = sig.x_shape[0], sig.w_shape[0]
        shape = (n, k, *out_spatial) if sig.kind == "conv3d" else (1, k, n, *out_spatial)
        stride = rt.dense_strides(shape, rt.ORDER_CL3D)
        site = Conv2Site(sig, shape, stride, stride, sig.dtype)
        out[site] = out.get(site, 0) + calls
    return out


# ---------------------------------------------------------------------------------------------
# Views between the conv output and the residual add's x
# ---------------------------------------------------------------------------------------------


def to_add_view(y: torch.Tensor, add_shape: tuple[int, ...]) -> torch.Tensor:
    """The conv output as the residual add sees it: itself (conv3d), or a conv2d's [B*T, C, H, W]
    as [B, C, T, H, W] (fast.py's view; a channels-last conv2d output is channels_last_3d here)."""
    if y.dim() == len(add_shape):
        return y
    b, _, t = add_shape[:3]
    return y.view(b, t, *y.shape[1:]).permute(0, 2, 1, 3, 4)


def to_conv_view(t: torch.Tensor, y_shape: tuple[int, ...]) -> torch.Tensor:
    """The inverse of to_add_view: a 5-D add result in the conv output's shape (for the checks)."""
    if t.dim() == len(y_shape):
        return t
    return t.permute(0, 2, 1, 3, 4).reshape(y_shape)


def broadcast_bias(bias: torch.Tensor, dims: int) -> torch.Tensor:
    """``bias`` [K] as [1, K, 1, ..] with channels-last broadcast strides (K, 1, K, ..), as the
    frontend's conv-bias samples give it; same storage."""
    k = bias.numel()
    return bias.as_strided((1, k, *([1] * (dims - 2))), (k, 1, *([k] * (dims - 2))))


# ---------------------------------------------------------------------------------------------
# Fused graphs
# ---------------------------------------------------------------------------------------------


def fe_dtype(fe: bc.Frontend, dtype: torch.dtype) -> Any:
    return getattr(fe.cudnn.data_type, bc.FE_DTYPES[dtype])


def build_fused_graph(
    fe: bc.Frontend, sig: bc.ConvSig, tensors: dict[str, torch.Tensor], y: torch.Tensor, *, residual: bool
) -> tuple[Any, dict, str | None]:
    """conv_fprop -> bias (-> add residual) in one graph, built like bench_convs.build_graph (all
    plans). ``tensors``: X, W, B (broadcast bias view), R (residual, y's shape and strides)."""
    cudnn = fe.cudnn
    if isinstance(sig.padding, str):
        raise bc.StepError("padding", ValueError(f"asymmetric padding={sig.padding!r} is not expressed here"))
    io = fe_dtype(fe, sig.torch_dtype)
    f32 = cudnn.data_type.FLOAT
    graph = bc._step("pygraph", lambda: cudnn.pygraph(
        io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=fe.handle))

    def tensor(name: str) -> Any:
        t = tensors[name]
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=fe_dtype(fe, t.dtype))

    X = bc._step("tensor X", lambda: tensor("X"))
    W = bc._step("tensor W", lambda: tensor("W"))
    B = bc._step("tensor B", lambda: tensor("B"))
    conv = bc._step("conv_fprop", lambda: graph.conv_fprop(
        image=X, weight=W, padding=list(sig.padding), stride=list(sig.stride), dilation=list(sig.dilation),
        compute_data_type=f32, name="conv"))
    bc._step("conv output (virtual, fp32)", lambda: conv.set_data_type(f32))
    out = bc._step("bias", lambda: graph.bias(input=conv, bias=B, compute_data_type=f32, name="bias"))
    pack = {X: tensors["X"], W: tensors["W"], B: tensors["B"]}
    if residual:
        R = bc._step("tensor R", lambda: tensor("R"))
        biased = out
        bc._step("bias output (virtual, fp32)", lambda: biased.set_data_type(f32))
        out = bc._step("add", lambda: graph.add(a=biased, b=R, compute_data_type=f32, name="residual"))
        pack[R] = tensors["R"]
    final = out
    bc._step("output Y", lambda: (final.set_output(True), final.set_data_type(io), final.set_dim(list(y.shape)),
                                  final.set_stride(list(y.stride()))))
    pack[final] = y
    bc._step("validate", graph.validate)
    bc._step("build_operation_graph", graph.build_operation_graph)
    bc._step("create_execution_plans", lambda: graph.create_execution_plans(fe.heuristics))
    bc._step("check_support", graph.check_support)
    build_error = None
    try:
        bc._step("build_plans(ALL)", lambda: graph.build_plans(cudnn.build_plan_policy.ALL))
    except bc.StepError as exc:
        build_error = str(exc)
        bc.build_each(graph)
    return graph, pack, build_error


@dataclass
class VariantResult:
    """One graph's plans (a plain conv, conv+bias+add or conv+bias)."""

    graph_error: str | None = None  # the graph step that failed, before any plan ran
    build_error: str | None = None  # build_plans(ALL) raised (then built one by one)
    plans: list[bc.PlanResult] = dataclasses.field(default_factory=list)
    best: int | None = None  # index into plans of the fastest within --max-err
    seq_ms: float | None = None  # the best plan then its residual kernel, back to back (not for fused)
    seq_error: str | None = None

    def best_plan(self) -> bc.PlanResult | None:
        return None if self.best is None else self.plans[self.best]

    def best_ms(self) -> float | None:
        best = self.best_plan()
        return best.ms if best else None

    def n_ok(self, max_err: float) -> int:
        return sum(p.ok(max_err) for p in self.plans)


@dataclass
class Built:
    graph: Any
    pack: dict


def run_variant(
    fe: bc.Frontend, build: Callable[[], tuple[Any, dict, str | None]], y: torch.Tensor, ref: torch.Tensor,
    iters: int, max_err: float,
) -> tuple[VariantResult, Built | None]:
    """Build a graph, run, check (against ``ref``) and time each of its plans."""
    try:
        graph, pack, build_error = build()
    except bc.StepError as exc:
        return VariantResult(graph_error=str(exc)), None
    v = VariantResult(build_error=build_error)
    v.plans = [bc.run_plan(fe, graph, pack, y, ref, i, iters) for i in range(bc.plan_count(graph))]
    if not v.plans:
        v.graph_error = "the frontend offered no execution plan"
    v.best = bc.pick_best(v.plans, max_err)
    return v, Built(graph, pack)


def time_plan_then(
    fe: bc.Frontend, v: VariantResult, built: Built | None, then: Callable[[], Any], iters: int
) -> None:
    """v.seq_ms: v's best plan, then ``then`` (the residual kernel), in one timed pair of events."""
    best = v.best_plan()
    if best is None or built is None:
        return
    try:
        ws = torch.empty(max(int(built.graph.get_workspace_size_plan_at_index(best.index)), 1),
                         dtype=torch.uint8, device=bc.DEVICE)

        def step() -> None:
            bc.execute_plan(fe, built.graph, built.pack, ws, best.index)
            then()

        v.seq_ms = gpu_ms(step, iters)
    except Exception as exc:  # noqa: BLE001 - report it, keep the run going
        v.seq_error = bc.error_text(exc)


# ---------------------------------------------------------------------------------------------
# One site
# ---------------------------------------------------------------------------------------------


@dataclass
class SiteResult:
    site: Conv2Site
    calls: int
    conv_ms: float | None = None  # (a) torch conv, no bias
    resid_ms: float | None = None  # (b) residual kernel alone (x + bias + h)
    resid_nobias_ms: float | None = None  # the kernel without a bias (x + h), after (e)
    seq_ms: float | None = None  # (c) = (a) then (b)
    error: str | None = None  # why (a)-(c) did not all run: the site is left out of the totals
    plain: VariantResult | None = None  # the plain conv's plans; .seq_ms = c' (None: --skip-plain)
    fused: VariantResult = dataclasses.field(default_factory=VariantResult)  # (d) conv+bias+add
    fused_bias: VariantResult = dataclasses.field(default_factory=VariantResult)  # (e) conv+bias; .seq_ms: + x+h

    def plan_ms(self) -> float | None:
        return self.plain.best_ms() if self.plain else None

    def plan_seq_ms(self) -> float | None:
        return self.plain.seq_ms if self.plain else None

    def base_ms(self) -> float | None:
        """Today's best: min(c, c')."""
        got = [m for m in (self.seq_ms, self.plan_seq_ms()) if m is not None]
        return min(got) if got else None

    def beats(self) -> str:
        f, c, base = self.fused.best_ms(), self.seq_ms, self.base_ms()
        if f is None or c is None:
            return "-"
        if base is not None and f < base:
            return "YES"
        return "yes" if f < c else "no"


def measure_site(
    fe: bc.Frontend, site: Conv2Site, calls: int, iters: int, max_err: float, plain: bool = True
) -> SiteResult:
    res = SiteResult(site, calls)
    sig = site.sig
    x, w = bc.conv_tensors(sig)
    run = bc.torch_conv(sig, x, w)
    try:
        y = run()
        res.conv_ms = gpu_ms(run, iters)
    except Exception as exc:  # noqa: BLE001
        res.error = f"torch conv: {bc.error_text(exc)}"
        return res
    shape, add_shape = tuple(y.shape), site.add_shape
    if math.prod(add_shape) != y.numel():
        res.error = f"the add's x {add_shape} does not hold the conv output {shape}"
        return res
    # the shortcut h in the conv output's layout (the graph's R; the kernel reads it through the add's view)
    h = bc.random_strided(shape, y.stride(), y.dtype)
    h5 = to_add_view(h, add_shape)
    bias_dtype = getattr(torch, (site.bias_dtype or sig.dtype).removeprefix("torch."))  # no bias seen: x's dtype
    bias = torch.randn(shape[1], device=bc.DEVICE, dtype=bias_dtype)
    ref = bias_residual_add(to_add_view(y, add_shape), h5, bias)
    if ref is None:
        res.error = "the residual kernel declined these tensors (layout, dtype or size)"
        return res
    res.resid_ms = gpu_ms(lambda: bias_residual_add(to_add_view(y, add_shape), h5, bias), iters)
    res.seq_ms = gpu_ms(lambda: bias_residual_add(to_add_view(run(), add_shape), h5, bias), iters)
    res.resid_nobias_ms = gpu_ms(lambda: bias_residual_add(to_add_view(y, add_shape), h5, None), iters)

    b = broadcast_bias(bias, y.dim())
    tensors = {"X": x, "W": w, "B": b, "R": h}
    if plain:
        y_plain = torch.empty_strided(shape, y.stride(), dtype=y.dtype, device=bc.DEVICE)
        res.plain, built = run_variant(fe, lambda: bc.build_graph(fe, sig, x, w, y_plain), y_plain, y, iters, max_err)
        time_plan_then(fe, res.plain, built,
                       lambda: bias_residual_add(to_add_view(y_plain, add_shape), h5, bias), iters)
        del built
    y_fused = torch.empty_strided(shape, y.stride(), dtype=y.dtype, device=bc.DEVICE)
    res.fused, built = run_variant(
        fe, lambda: build_fused_graph(fe, sig, tensors, y_fused, residual=True), y_fused,
        to_conv_view(ref, shape), iters, max_err)
    del built
    ref_bias = (y.float() + b.float()).to(y.dtype)  # torch's conv, the bias added in fp32, one rounding
    y_bias = torch.empty_strided(shape, y.stride(), dtype=y.dtype, device=bc.DEVICE)
    res.fused_bias, built = run_variant(
        fe, lambda: build_fused_graph(fe, sig, tensors, y_bias, residual=False), y_bias, ref_bias, iters, max_err)
    time_plan_then(fe, res.fused_bias, built,
                   lambda: bias_residual_add(to_add_view(y_bias, add_shape), h5, None), iters)
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def chunk_totals(results: list[SiteResult]) -> dict[str, float]:
    """Per-chunk ms (sum of ms x calls) over the sites whose (c) ran. A variant without a usable
    plan counts at (c)'s time (c' at c's, plan at conv's); ``best`` is the per-site min of c, c',
    fused and cb+r."""
    keys = ("conv", "plan", "residual", "c", "c_plan", "baseline", "fused", "fused_bias_then_add", "best")
    tot = dict.fromkeys(keys, 0.0)
    tot["calls"] = 0.0
    for r in results:
        if r.seq_ms is None or r.conv_ms is None or r.resid_ms is None:
            continue
        c = r.seq_ms
        c_plan = r.plan_seq_ms() or c
        fused = r.fused.best_ms() or c
        bias_add = r.fused_bias.seq_ms or c
        per = {"conv": r.conv_ms, "plan": r.plan_ms() or r.conv_ms, "residual": r.resid_ms, "c": c,
               "c_plan": c_plan, "baseline": min(c, c_plan), "fused": fused, "fused_bias_then_add": bias_add,
               "best": min(c, c_plan, fused, bias_add)}
        for k, ms in per.items():
            tot[k] += ms * r.calls
        tot["calls"] += r.calls
    return tot


def savings(results: list[SiteResult]) -> dict[str, float]:
    """Per chunk: what the fused conv+bias+add graph saves where it wins, against (c) and against
    min(c, c'); and what the best of everything saves against min(c, c')."""
    out = {"vs_c": 0.0, "vs_baseline": 0.0, "best_vs_baseline": 0.0}
    tot = chunk_totals(results)
    for r in results:
        f, c, base = r.fused.best_ms(), r.seq_ms, r.base_ms()
        if c is None or base is None or r.conv_ms is None or r.resid_ms is None:
            continue
        if f is not None:
            out["vs_c"] += max(c - f, 0.0) * r.calls
            out["vs_baseline"] += max(base - f, 0.0) * r.calls
    out["best_vs_baseline"] = tot["baseline"] - tot["best"]
    return out


def _ms(ms: float | None, width: int = 7) -> str:
    return f"{ms:{width}.3f}" if ms is not None else f"{'-':>{width}s}"


def _ratio(num: float | None, den: float | None) -> str:
    return f"{num / den:5.2f}x" if num and den else f"{'-':>6s}"


HEADER = (f"{'#':>2s}  {'conv2 site':52s} {'calls':>5s} | {'conv':>7s} {'plan':>7s} {'resid':>7s} | {'c':>7s} "
          f"{C_PLAN:>7s} | {'fused':>7s} {'ok/n':>5s} {'err':>6s} | {'cb':>7s} {'cb+r':>7s} | {'x c':>6s} "
          f"{'x best':>6s} {'beats':>5s}  best fused plan")


def site_line(k: int, r: SiteResult, max_err: float) -> str:
    fb = r.fused.best_plan()
    err = f"{fb.rel_err:6.4f}" if fb and fb.rel_err is not None else f"{'-':>6s}"
    ok = f"{r.fused.n_ok(max_err)}/{len(r.fused.plans)}"
    return (f"{k:2d}  {r.site.label():52s} {r.calls:5d} | {_ms(r.conv_ms)} {_ms(r.plan_ms())} {_ms(r.resid_ms)} | "
            f"{_ms(r.seq_ms)} {_ms(r.plan_seq_ms())} | {_ms(r.fused.best_ms())} {ok:>5s} {err} | "
            f"{_ms(r.fused_bias.best_ms())} {_ms(r.fused_bias.seq_ms)} | {_ratio(r.seq_ms, r.fused.best_ms())} "
            f"{_ratio(r.base_ms(), r.fused.best_ms())} {r.beats():>5s}  {fb.name if fb else '-'}")


def variant_notes(tag: str, v: VariantResult | None, max_err: float, max_plans: int = 4) -> list[str]:
    if v is None:
        return []
    notes = []
    if v.graph_error:
        notes.append(f"{tag}: {v.graph_error}")
    if v.build_error:
        notes.append(f"{tag}: {v.build_error} (plans then built one by one)")
    if v.seq_error:
        notes.append(f"{tag} then the residual kernel: {v.seq_error}")
    bad = [p for p in v.plans if not p.ok(max_err)]
    for p in bad[:max_plans]:
        notes.append(f"{tag} plan {p.index} {p.name}: {p.why_not_counted(max_err)}")
    if len(bad) > max_plans:
        notes.append(f"{tag}: ... {len(bad) - max_plans} more plans did not count (see --json)")
    return notes


def site_notes(r: SiteResult, max_err: float) -> list[str]:
    notes = [f"left out of the totals: {r.error}"] if r.error else []
    notes += variant_notes("plain conv", r.plain, max_err, max_plans=2)
    notes += variant_notes("conv+bias+add", r.fused, max_err)
    notes += variant_notes("conv+bias", r.fused_bias, max_err)
    return notes


def print_summary(results: list[SiteResult], video_chunks: int) -> dict[str, Any]:
    tot, save = chunk_totals(results), savings(results)
    counted = [r for r in results if r.seq_ms is not None]
    print(f"\n========== summary: {len(counted)} of {len(results)} conv2 sites measured, "
          f"{int(tot['calls'])} calls per steady chunk ==========")
    print(f"per chunk (sum of ms x calls): conv {tot['conv']:.3f}, best plain plan {tot['plan']:.3f}, residual "
          f"kernel {tot['residual']:.3f}; c {tot['c']:.3f}, c' {tot['c_plan']:.3f}, min(c, c') {tot['baseline']:.3f}; "
          f"fused conv+bias+add {tot['fused']:.3f}, conv+bias then x+h {tot['fused_bias_then_add']:.3f}; "
          f"best of all {tot['best']:.3f}  (a failed variant counts at c)")
    for key, what, ref in (("vs_c", "fused where it beats c, against c", tot["c"]),
                           ("vs_baseline", "fused where it beats min(c, c'), against min(c, c')", tot["baseline"]),
                           ("best_vs_baseline", "best of all per site, against min(c, c')", tot["baseline"])):
        pct = 100 * save[key] / ref if ref else math.nan
        print(f"saving, {what}: {save[key]:.3f} ms per chunk ({pct:.1f} %), "
              f"{save[key] * video_chunks:.1f} ms per {video_chunks}-chunk video")
    wins = [r for r in results if r.beats() in ("yes", "YES")]
    print(f"sites where fused beats c: {len(wins)} of {len(counted)}"
          + "".join(f"\n  {r.site.label()} x{r.calls}: c {r.seq_ms:.3f}, min(c, c') {r.base_ms():.3f} -> "
                    f"{r.fused.best_ms():.3f} ms ({p.name if (p := r.fused.best_plan()) else '-'})" for r in wins))
    no_plan = [r for r in counted if r.fused.best is None]
    if no_plan:
        print(f"sites with no usable fused plan (counted at c): {len(no_plan)}")
    return {"per_chunk_ms": tot, "saving_per_chunk_ms": save, "video_chunks": video_chunks,
            "saving_per_video_ms": {k: v * video_chunks for k, v in save.items()}, "fused_wins": len(wins)}


def result_json(r: SiteResult) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["label"] = r.site.label()
    d["base_ms"], d["beats"] = r.base_ms(), r.beats()
    for key, v in (("plain", r.plain), ("fused", r.fused), ("fused_bias", r.fused_bias)):
        best = v.best_plan() if v else None
        d[f"{key}_best_ms"], d[f"{key}_best_name"] = (best.ms, best.name) if best else (None, None)
    return d


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from vaed.models import RANDOM_CONFIGS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wan2.1", choices=sorted(RANDOM_CONFIGS),
                        help="random-weight architecture (vaed.models.RANDOM_CONFIGS)")
    parser.add_argument("--latent", type=bc.parse_hw, default=None,
                        help="latent H,W (default: 480x832 over the model's spatial scale, 60,104 for wan2.1)")
    parser.add_argument("--frames", type=int, default=3, help="latent frames decoded; the last one is recorded")
    parser.add_argument("--iters", type=int, default=20, help="timed launches per measurement (median reported)")
    parser.add_argument("--heuristics", default=bc.DEFAULT_HEURISTICS,
                        help="cudnn.heur_mode names, comma separated (A, B, FALLBACK)")
    parser.add_argument("--max-err", type=float, default=bc.DEFAULT_MAX_ERR,
                        help="a plan counts only within this max |plan - ref| / max |ref|")
    parser.add_argument("--select", default="sites", choices=SELECT_MODES,
                        help="sites: conv2 exactly, from the residual adds; square: 3x3x3 convs with in = out")
    parser.add_argument("--skip-plain", action="store_true", help="leave out the plain-conv plans (plan, c')")
    parser.add_argument("--video-chunks", type=int, default=bc.VIDEO_CHUNKS, help="chunks per video for the projection")
    parser.add_argument("--json", metavar="PATH", help="write the per-site results and the summary here")
    args = parser.parse_args(argv)
    if args.frames < 2:
        parser.error("--frames must be >= 2 (the recorded frame must be a steady chunk)")
    return args


def environment(heuristics: str) -> bc.Frontend | str:
    """The frontend, or why this machine cannot run the benchmark."""
    fe = bc.check_environment(heuristics)
    if isinstance(fe, str):
        return fe
    if not rt.triton_available():
        return "needs Triton for the residual kernel"
    return fe


def record_sites(model: str, hw: tuple[int, int], frames: int, select: str) -> tuple[dict[Conv2Site, int], str]:
    """The fast tier's conv2 sites of a steady chunk, and a line on how they were found."""
    vae, ops = bc.build_decoder(model, "fast")
    z = bc.latents_for(vae, hw, frames)
    note = ""
    sites: dict[Conv2Site, int] = {}
    if select == "sites":
        sites, unmatched = record_conv2_sites(vae, z, ops)
        note = f"{sum(sites.values())} residual adds matched to their conv2, {unmatched} unmatched"
        if not sites:
            select, note = "square", note + "; none matched: falling back to --select square"
    if select == "square":
        sites = square_sites(bc.record_steady_chunk(vae, z, ops))
        note = (note + "; " if note else "") + "square: 3x3x3 convs with in = out channels (conv1s with in = out too)"
    del vae, z, ops
    gc.collect()
    torch.cuda.empty_cache()
    return sites, note


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fe = environment(args.heuristics)
    if isinstance(fe, str):
        print(fe, file=sys.stderr)
        return 2
    hw = args.latent or bc.default_latent(args.model)
    versions = fe.versions()
    print(f"torch {torch.__version__}, cuDNN (torch) {torch.backends.cudnn.version()}, cudnn frontend "
          f"{versions['frontend']} (backend {versions['backend']}), {torch.cuda.get_device_name(0)}, "
          f"cudnn.benchmark={torch.backends.cudnn.benchmark}")
    sites, note = record_sites(args.model, hw, args.frames, args.select)
    print(f"{args.model} fast, latent {args.frames}x{hw[0]}x{hw[1]}: {len(sites)} conv2 sites, "
          f"{sum(sites.values())} calls in the last (steady) chunk ({note}); heuristics {args.heuristics}, "
          f"median of {args.iters} launches", flush=True)

    results = []
    for i, (site, calls) in enumerate(sites.items()):
        t0 = time.perf_counter()
        try:
            r = measure_site(fe, site, calls, args.iters, args.max_err, plain=not args.skip_plain)
        except Exception as exc:  # noqa: BLE001 - one site never ends the run
            r = SiteResult(site, calls, error=f"measuring: {bc.error_text(exc)}")
        results.append(r)
        gc.collect()
        torch.cuda.empty_cache()
        # each site's line as it is measured (seconds to a minute each: every fused plan is built),
        # so a run stopped by a time limit still reports the sites it got through
        print(f"  [{i + 1}/{len(sites)}] {site.label()} measured in {time.perf_counter() - t0:.1f} s\n"
              f"      {site_line(i, r, args.max_err)}", file=sys.stderr, flush=True)
    results.sort(key=lambda r: -(r.seq_ms or 0.0) * r.calls)
    print("\n" + HEADER)
    for k, r in enumerate(results):
        print(site_line(k, r, args.max_err))
        for n in site_notes(r, args.max_err):
            print(f"      {n}")
    summary = print_summary(results, args.video_chunks)
    if args.json:
        out = {"env": bc.run_environment(versions), "args": vars(args) | {"latent": list(hw)}, "selection": note,
               "sites": [result_json(r) for r in results], "summary": summary}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
