"""Do other cuDNN engines beat the one torch picks, on the Wan decoder's real conv shapes?

Builds a random-weight Wan VAE (bf16, channels_last, Triton kernels, the chosen tier
installed), runs the engine's decode loop (post_quant_conv, then one decoder call per
latent frame with a session cache) and records every ``F.conv2d`` / ``F.conv3d`` call of
the LAST latent frame, a steady chunk: input and weight shapes and strides, stride,
padding, dilation, groups, dtype, and how often each signature runs per chunk. The
module attributes of ``torch.nn.functional`` are wrapped, so both the fast tier's
direct ``F.conv2d`` calls and ``nn.Conv3d._conv_forward`` (which calls ``F.conv3d``)
are caught.

Then, for each unique signature, on fresh random tensors with the recorded shapes AND
strides (bias left out: torch adds a cuDNN conv's bias in a pass of its own, a separate
question):

* torch's own call with the same arguments, ``torch.backends.cudnn.benchmark`` as it is
  (False by default: torch takes cuDNN's heuristic pick), and which backend torch
  dispatches to (``torch._C._select_conv_backend``);
* every execution plan the cuDNN frontend (``nvidia-cudnn-frontend``, imported as
  ``cudnn``) offers for the same conv, bf16 in and out, fp32 compute, with the output
  strides torch's conv returns: heuristics ``A`` + ``FALLBACK`` by default, all plans
  built (``build_plan_policy.ALL``), each executed, checked against torch's output
  (max |plan - torch| / max |torch|; ~0.004 is one bf16 ulp at the largest output) and
  timed. A plan whose error exceeds ``--max-err`` (or that writes NaN) is listed but
  never counted as the best;
* with ``--triton``, the candidate Triton implicit-GEMM conv (``benchmarks/triton_conv.py``)
  where it takes the signature (bf16 channels-last input, stride 1, dilation 1, groups 1):
  each of its configs (``triton_conv.configs_for``) launched, checked against torch's output
  like a plan (the same error and ``--max-err``) and timed, the weight repacked once outside
  the timed call; the fastest config within ``--max-err`` is the shape's Triton result.

Timing: the planner's own (``vaed.patches.conv_plans.gpu_ms``): ``--iters`` single
launches after 2 warm-ups, each between its own pair of CUDA events, median reported.
Before each launch the stream is held by a ~0.5 ms GPU sleep (``torch.cuda._sleep``), so
the host cost of a launch (the frontend's Python execute path, torch's dispatch) is
hidden and the events measure GPU time only. Tensors stay
resident between launches (L2 is not flushed), the same for torch and for every plan.

Per shape it prints the signature (conv kind, channels in -> out, kernel, input dims,
calls per chunk), TFLOP per call, torch ms and TFLOP/s, the heuristic's first plan
(index 0) ms, the best plan's ms, TFLOP/s and speedup over torch, plans that ran / were
tried, and the best plan's name; then per-chunk totals (sum of ms x calls) for torch,
plan 0, the best plans and the best of both, and the projected saving per chunk and
per video (``--video-chunks``, 21: 480x832x81 has 21 latent frames). With ``--triton`` each
shape's line also has the best Triton config's ms, TFLOP/s, speedup over torch, configs
within ``--max-err`` / tried, error and name (before the best plan's), its notes the configs
that failed, and the summary the best Triton configs' total, the best of torch, plans and
Triton, its saving and the shapes where Triton beats both; ``--json`` carries them too. A
shape Triton does not take counts at torch's ms in its column.

Run on the GPU machine from the repository root (needs ``pip install nvidia-cudnn-frontend``):
    python benchmarks/bench_convs.py --model wan2.1 --tier fast
    python benchmarks/bench_convs.py --model wan2.2 --tier lossless --json /tmp/convs.json
    python benchmarks/bench_convs.py --model wan2.1 --tier fast --triton  # + the Triton candidate
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
from typing import Any

import torch

from vaed.models import RANDOM_CONFIGS
from vaed.patches.conv_plans import gpu_ms, per_dim

DEVICE = "cuda"
VIDEO_SIZE = (480, 832)  # the default --latent is this size over the model's spatial scale
VIDEO_CHUNKS = 21  # latent frames of an 81-frame video (temporal scale 4)
DEFAULT_HEURISTICS = "A,FALLBACK"
DEFAULT_MAX_ERR = 0.02  # max |plan - torch| / max |torch|; ~5 bf16 ulps at the largest output
FE_DTYPES = {torch.bfloat16: "BFLOAT16", torch.float16: "HALF", torch.float32: "FLOAT"}


# ---------------------------------------------------------------------------------------------
# Conv signatures and their recording
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConvSig:
    """One unique conv call: what torch was asked to do, bias aside."""

    kind: str  # "conv2d" or "conv3d"
    x_shape: tuple[int, ...]
    x_stride: tuple[int, ...]
    w_shape: tuple[int, ...]
    w_stride: tuple[int, ...]
    bias: bool  # the recorded call had a bias (timed without: see the docstring)
    stride: tuple[int, ...]
    padding: tuple[int, ...] | str  # a string only for a 'same' padding that is not symmetric
    dilation: tuple[int, ...]
    groups: int
    dtype: str  # e.g. "torch.bfloat16"

    @property
    def spatial(self) -> int:
        return len(self.x_shape) - 2

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype.removeprefix("torch."))

    def out_spatial(self) -> tuple[int, ...]:
        if isinstance(self.padding, str):
            return self.x_shape[2:]  # 'same'
        out = []
        for i in range(self.spatial):
            eff = (self.w_shape[i + 2] - 1) * self.dilation[i] + 1
            out.append((self.x_shape[i + 2] + 2 * self.padding[i] - eff) // self.stride[i] + 1)
        return tuple(out)

    def flop(self) -> float:
        """2 x MACs: 2 * N * C_out * prod(out dims) * C_in/groups * prod(kernel)."""
        n, c_out, c_in_per_group = self.x_shape[0], self.w_shape[0], self.w_shape[1]
        return 2.0 * n * c_out * math.prod(self.out_spatial()) * c_in_per_group * math.prod(self.w_shape[2:])

    def layout(self) -> str:
        probe = torch.empty_strided(self.x_shape, self.x_stride, device="meta")
        fmt = torch.channels_last if self.spatial == 2 else torch.channels_last_3d
        if probe.is_contiguous(memory_format=fmt):
            return "cl"
        return "contig" if probe.is_contiguous() else "strided"

    def label(self) -> str:
        """e.g. `conv3d 384->384 k3x3x3 in 3x62x106 cl`."""
        c_in = self.w_shape[1] * self.groups
        kernel = "x".join(map(str, self.w_shape[2:]))
        dims = "x".join(map(str, self.x_shape[2:]))
        extra = []
        if any(s != 1 for s in self.stride):
            extra.append("s" + "x".join(map(str, self.stride)))
        if isinstance(self.padding, str) or any(self.padding):
            extra.append("p" + (self.padding if isinstance(self.padding, str) else "x".join(map(str, self.padding))))
        if any(d != 1 for d in self.dilation):
            extra.append("d" + "x".join(map(str, self.dilation)))
        if self.groups != 1:
            extra.append(f"g{self.groups}")
        if self.x_shape[0] != 1:
            extra.append(f"n{self.x_shape[0]}")
        tail = (" " + ",".join(extra)) if extra else ""
        return f"{self.kind} {c_in}->{self.w_shape[0]} k{kernel} in {dims} {self.layout()}{tail}"


def _padding(value: Any, w_shape: tuple[int, ...], dilation: tuple[int, ...]) -> tuple[int, ...] | str:
    """Explicit symmetric padding; torch's 'valid' and 'same' strings resolved where they can be."""
    n = len(w_shape) - 2
    if not isinstance(value, str):
        return per_dim(value, n)
    if value == "valid":
        return (0,) * n
    totals = [d * (k - 1) for d, k in zip(dilation, w_shape[2:], strict=True)]
    return tuple(t // 2 for t in totals) if all(t % 2 == 0 for t in totals) else value


_CONV_ARGS = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
_CONV_DEFAULTS: dict[str, Any] = {"bias": None, "stride": 1, "padding": 0, "dilation": 1, "groups": 1}


def signature_of(kind: str, args: tuple, kwargs: dict[str, Any]) -> ConvSig:
    """The ConvSig of one `F.conv2d` / `F.conv3d` call, whatever mix of positional and keyword args."""
    bound = dict(_CONV_DEFAULTS)
    bound.update(zip(_CONV_ARGS, args, strict=False))  # fewer positional args than names
    bound.update(kwargs)
    x, w = bound["input"], bound["weight"]
    n = w.dim() - 2
    dilation = per_dim(bound["dilation"], n)
    return ConvSig(
        kind=kind,
        x_shape=tuple(x.shape), x_stride=tuple(x.stride()),
        w_shape=tuple(w.shape), w_stride=tuple(w.stride()),
        bias=bound["bias"] is not None,
        stride=per_dim(bound["stride"], n),
        padding=_padding(bound["padding"], tuple(w.shape), dilation),
        dilation=dilation,
        groups=int(bound["groups"]),
        dtype=str(x.dtype),
    )


ConvFn = Callable[..., torch.Tensor]


@contextmanager
def wrapped_convs(wrap: Callable[[str, ConvFn], ConvFn]) -> Iterator[None]:
    """``torch.nn.functional.conv2d`` / ``conv3d`` replaced by ``wrap(kind, original)`` while
    inside: the module attributes, which the fast tier's direct calls and ``nn.Conv3d``'s
    forward both go through."""
    fn = torch.nn.functional
    originals = {kind: getattr(fn, kind) for kind in ("conv2d", "conv3d")}
    try:
        for kind, original in originals.items():
            setattr(fn, kind, wrap(kind, original))
        yield
    finally:
        for kind, original in originals.items():
            setattr(fn, kind, original)


@contextmanager
def recording_convs(counts: dict[ConvSig, int]) -> Iterator[None]:
    """Count every F.conv2d / F.conv3d call per signature into `counts` while inside."""

    def wrap(kind: str, original: ConvFn) -> ConvFn:
        def conv(*args: Any, **kwargs: Any) -> torch.Tensor:
            sig = signature_of(kind, args, kwargs)
            counts[sig] = counts.get(sig, 0) + 1
            return original(*args, **kwargs)

        return conv

    with wrapped_convs(wrap):
        yield


def num_causal_convs(vae: Any) -> int:
    return sum(1 for m in vae.decoder.modules() if type(m).__name__ == "WanCausalConv3d")


@torch.inference_mode()
def record_steady_chunk(vae: Any, z: torch.Tensor, ops: Any) -> dict[ConvSig, int]:
    """The engine's loop over `z`'s latent frames under `ops`; the convs of the last frame only."""
    from vaed import patches as P

    if z.shape[2] < 2:
        raise ValueError("need at least 2 latent frames: the last one must be a steady chunk")
    counts: dict[ConvSig, int] = {}
    cache: list = [None] * num_causal_convs(vae)
    x = vae.post_quant_conv(z)
    last = x.shape[2] - 1
    with P.using(ops):
        for i in range(last + 1):
            chunk = x[:, :, i : i + 1]
            if i < last:
                vae.decoder(chunk, feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
                continue
            with recording_convs(counts):
                vae.decoder(chunk, feat_cache=cache, feat_idx=[0], first_chunk=False)
    return counts


def build_decoder(model: str, tier: str, kernels: str = "triton", device: str = DEVICE) -> tuple[Any, Any]:
    """(bf16 random-weight VAE in eval mode, the tier's checked op set)."""
    from diffusers.utils import logging as diffusers_logging

    from vaed import patches as P
    from vaed.models import build_random_vae

    vae = build_random_vae(model)
    level = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # its warning on every .to(dtype) of a Wan VAE
    try:
        vae = vae.to(device, torch.bfloat16).eval().requires_grad_(False)
    finally:
        diffusers_logging.set_verbosity(level)
    rep = P.prepare_decoder(vae, kernels=kernels, layout="channels_last", tiers=("fast", "lossless"))
    return vae, rep.ops_for(tier)


def latents_for(vae: Any, hw: tuple[int, int], frames: int, device: str = DEVICE) -> torch.Tensor:
    from vaed import patches as P

    torch.manual_seed(0)
    z = torch.randn(1, vae.config.z_dim, frames, *hw, device=device, dtype=torch.bfloat16)
    return P.to_decoder_layout(z, "channels_last")


# ---------------------------------------------------------------------------------------------
# Timing and tensors
# ---------------------------------------------------------------------------------------------


def random_strided(
    shape: tuple[int, ...], stride: tuple[int, ...], dtype: torch.dtype, std: float = 1.0
) -> torch.Tensor:
    t = torch.empty_strided(shape, stride, device=DEVICE, dtype=dtype)
    try:
        return t.normal_(0.0, std)
    except RuntimeError:  # overlapping strides (an expanded view): fill the storage instead
        t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,)).normal_(0.0, std)
        return t


def conv_tensors(sig: ConvSig) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = sig.torch_dtype
    fan_in = math.prod(sig.w_shape[1:])
    x = random_strided(sig.x_shape, sig.x_stride, dtype)
    w = random_strided(sig.w_shape, sig.w_stride, dtype, std=fan_in**-0.5)
    return x, w


def torch_conv(sig: ConvSig, x: torch.Tensor, w: torch.Tensor) -> Callable[[], torch.Tensor]:
    conv = getattr(torch.nn.functional, sig.kind)
    return lambda: conv(x, w, None, sig.stride, sig.padding, sig.dilation, sig.groups)


def torch_backend(sig: ConvSig, x: torch.Tensor, w: torch.Tensor) -> str:
    """The ConvBackend torch dispatches this conv to (private API; '?' where it moved)."""
    if isinstance(sig.padding, str):
        return "?"
    try:
        backend = torch._C._select_conv_backend(
            x, w, None, list(sig.stride), list(sig.padding), list(sig.dilation), False, [0] * sig.spatial,
            sig.groups, None,
        )
    except Exception:  # noqa: BLE001 - private, its signature moves between torch releases
        return "?"
    return str(backend).rsplit(".", 1)[-1]


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (NaN when got holds NaN)."""
    scale = want.float().abs().max().item()
    diff = (got.float() - want.float()).abs().max().item()
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def error_text(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------------------------------------
# cuDNN frontend
# ---------------------------------------------------------------------------------------------


class StepError(Exception):
    """A graph step the frontend refused: `step` names it, the message is the frontend's."""

    def __init__(self, step: str, exc: BaseException):
        super().__init__(f"{step}: {error_text(exc)}")
        self.step = step


def _step(step: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - frontend versions raise their own types
        raise StepError(step, exc) from exc


@dataclass
class PlanResult:
    index: int
    name: str
    workspace_bytes: int | None = None
    ms: float | None = None
    rel_err: float | None = None
    error: str | None = None  # why it did not run (or ran wrong: see ok())

    def ok(self, max_err: float) -> bool:
        return self.ms is not None and self.rel_err is not None and self.rel_err <= max_err

    def why_not_counted(self, max_err: float) -> str | None:
        """Why this plan (or Triton config) is not a candidate for the best, or None if it is."""
        if self.error:
            return self.error
        if not self.ok(max_err):
            return f"rel err {self.rel_err:.4g} > --max-err {max_err} (not counted)"
        return None


@dataclass
class Frontend:
    """The imported cudnn module and one handle on torch's current stream."""

    cudnn: Any
    handle: Any
    heuristics: list[Any]

    @classmethod
    def open(cls, heuristics: str) -> Frontend:
        import cudnn

        handle = cudnn.create_handle()
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        modes = [getattr(cudnn.heur_mode, name.strip().upper()) for name in heuristics.split(",") if name.strip()]
        return cls(cudnn, handle, modes)

    def versions(self) -> dict[str, Any]:
        out: dict[str, Any] = {"frontend": getattr(self.cudnn, "__version__", "?")}
        try:
            out["backend"] = self.cudnn.backend_version()
        except Exception as exc:  # noqa: BLE001
            out["backend"] = f"? ({error_text(exc, 80)})"
        return out


def build_graph(
    fe: Frontend, sig: ConvSig, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor
) -> tuple[Any, dict, str | None]:
    """(the planned and built graph of `sig`, its variant pack, build_plans(ALL)'s error if it raised:
    then each plan is built on its own, and those that do not build fail at execute)."""
    cudnn = fe.cudnn
    if isinstance(sig.padding, str):
        raise StepError("padding", ValueError(f"asymmetric padding={sig.padding!r} is not expressed here"))
    padding = list(sig.padding)
    io = getattr(cudnn.data_type, FE_DTYPES[sig.torch_dtype])
    f32 = cudnn.data_type.FLOAT
    graph = _step("pygraph", lambda: cudnn.pygraph(
        io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=fe.handle))

    def io_tensor(name: str, t: torch.Tensor) -> Any:
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=io)

    X = _step("tensor X", lambda: io_tensor("X", x))
    W = _step("tensor W", lambda: io_tensor("W", w))
    Y = _step("conv_fprop", lambda: graph.conv_fprop(
        image=X, weight=W, padding=padding, stride=list(sig.stride), dilation=list(sig.dilation),
        compute_data_type=f32, name="conv"))
    _step("output Y", lambda: (Y.set_output(True), Y.set_data_type(io), Y.set_dim(list(y.shape)),
                               Y.set_stride(list(y.stride()))))
    _step("validate", graph.validate)
    _step("build_operation_graph", graph.build_operation_graph)
    _step("create_execution_plans", lambda: graph.create_execution_plans(fe.heuristics))
    _step("check_support", graph.check_support)
    build_error = None
    try:
        _step("build_plans(ALL)", lambda: graph.build_plans(cudnn.build_plan_policy.ALL))
    except StepError as exc:
        build_error = str(exc)
        build_each(graph)  # some versions fail the whole call for one plan; others build the rest
    return graph, {X: x, W: w, Y: y}, build_error


def build_each(graph: Any) -> None:
    """Build plans one index at a time where build_plans(ALL) gave up; what fails shows at execute."""
    build_at = getattr(graph, "build_plan_at_index", None)
    if build_at is None:
        return
    for i in range(plan_count(graph)):
        try:
            build_at(i)
        except Exception:  # noqa: BLE001 - reported per plan when it fails to execute
            pass


def plan_count(graph: Any) -> int:
    try:
        return int(graph.get_execution_plan_count())
    except Exception:  # noqa: BLE001
        return 0


def plan_name(graph: Any, i: int) -> str:
    get = getattr(graph, "get_plan_name_at_index", None)
    if get is None:
        return f"plan{i}"
    try:
        return str(get(i))
    except Exception:  # noqa: BLE001
        return f"plan{i}"


def execute_plan(fe: Frontend, graph: Any, pack: dict, workspace: torch.Tensor, i: int) -> None:
    """One launch of plan `i`: positional args, as both the classic (pybind) and the
    Python-graph frontends take (variant pack, workspace, index, handle)."""
    graph.execute_plan_at_index(pack, workspace, i, fe.handle)


def run_plan(
    fe: Frontend, graph: Any, pack: dict, y: torch.Tensor, ref: torch.Tensor, i: int, iters: int
) -> PlanResult:
    res = PlanResult(i, plan_name(graph, i))
    try:
        res.workspace_bytes = int(graph.get_workspace_size_plan_at_index(i))
        workspace = torch.empty(max(res.workspace_bytes, 1), dtype=torch.uint8, device=DEVICE)
        y.fill_(math.nan)  # a plan that writes nothing reads as NaN, not as torch's output
        execute_plan(fe, graph, pack, workspace, i)
        torch.cuda.synchronize()
        res.rel_err = rel_err(y, ref)
        res.ms = gpu_ms(lambda: execute_plan(fe, graph, pack, workspace, i), iters)
    except Exception as exc:  # noqa: BLE001 - unbuilt plans, execute refusals, workspace OOM
        res.error = error_text(exc)
    return res


# ---------------------------------------------------------------------------------------------
# One shape
# ---------------------------------------------------------------------------------------------


@dataclass
class ShapeResult:
    sig: ConvSig
    calls: int
    tflop: float  # per call
    torch_ms: float | None = None
    torch_backend: str = "?"
    torch_error: str | None = None
    graph_error: str | None = None  # the graph step that failed, before any plan ran
    build_error: str | None = None  # build_plans(ALL) raised (the plans were then built one by one)
    plans: list[PlanResult] = dataclasses.field(default_factory=list)
    best: int | None = None  # index into plans of the fastest plan within --max-err
    # --triton: one result per triton_conv config (index: its place in configs_for's list)
    triton: list[PlanResult] = dataclasses.field(default_factory=list)
    triton_best: int | None = None  # index into triton of the fastest config within --max-err
    triton_skip: str | None = None  # why the Triton conv did not run (a signature it does not take, ...)

    def best_plan(self) -> PlanResult | None:
        return None if self.best is None else self.plans[self.best]

    def best_triton(self) -> PlanResult | None:
        return None if self.triton_best is None else self.triton[self.triton_best]

    def plan0(self) -> PlanResult | None:
        return self.plans[0] if self.plans and self.plans[0].index == 0 else None

    def n_ok(self, max_err: float) -> int:
        return sum(p.ok(max_err) for p in self.plans)


def pick_best(plans: list[PlanResult], max_err: float) -> int | None:
    ok = [(p.ms, k) for k, p in enumerate(plans) if p.ok(max_err)]
    return min(ok)[1] if ok else None


def measure_triton(
    sig: ConvSig, x: torch.Tensor, w: torch.Tensor, ref: torch.Tensor, iters: int, *,
    timer: Callable[[Callable[[], Any], int], float] = gpu_ms, configs: list[Any] | None = None,
) -> tuple[list[PlanResult], str | None]:
    """(one result per Triton config: name, ms, rel_err against torch's ``ref`` or why it failed;
    why no config ran, e.g. a signature triton_conv does not take). The weight is repacked
    once, outside the timed launches; ``configs`` defaults to ``triton_conv.configs_for``'s."""
    import triton_conv as tc  # benchmarks/triton_conv.py, beside this script (only for --triton)

    reason = tc.why_unsupported(sig.x_shape, sig.x_stride, sig.w_shape, sig.stride, sig.padding, sig.dilation,
                                sig.groups, sig.dtype)
    if reason is None and not tc.available():
        reason = "triton is not importable"
    if reason is not None:
        return [], reason
    packed = tc.prepare_weight(w)
    runs = tc.time_configs(x, packed, sig.w_shape, sig.padding, check=lambda y: rel_err(y, ref), iters=iters,
                           configs=configs, timer=timer)
    return [PlanResult(i, r.config.name, ms=r.ms, rel_err=r.err, error=r.error) for i, r in enumerate(runs)], None


def measure_shape(
    fe: Frontend, sig: ConvSig, calls: int, iters: int, max_err: float, triton: bool = False
) -> ShapeResult:
    res = ShapeResult(sig, calls, sig.flop() / 1e12)
    x, w = conv_tensors(sig)
    run = torch_conv(sig, x, w)
    res.torch_backend = torch_backend(sig, x, w)
    try:
        ref = run()
        res.torch_ms = gpu_ms(run, iters)
    except Exception as exc:  # noqa: BLE001
        res.torch_error = error_text(exc)
        return res
    if triton:  # before the frontend's graph, whose errors end the shape
        try:
            res.triton, res.triton_skip = measure_triton(sig, x, w, ref, iters)
        except Exception as exc:  # noqa: BLE001 - each config's errors are caught inside; this is the rest
            res.triton_skip = error_text(exc)
        res.triton_best = pick_best(res.triton, max_err)
    y = torch.empty_strided(ref.shape, ref.stride(), dtype=ref.dtype, device=DEVICE)
    try:
        graph, pack, res.build_error = build_graph(fe, sig, x, w, y)
    except StepError as exc:
        res.graph_error = str(exc)
        return res
    res.plans = [run_plan(fe, graph, pack, y, ref, i, iters) for i in range(plan_count(graph))]
    if not res.plans:
        res.graph_error = "the frontend offered no execution plan"
    res.best = pick_best(res.plans, max_err)
    del graph, pack
    return res


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def tflops(tflop: float, ms: float | None) -> float:
    return math.nan if not ms else tflop / (ms * 1e-3)


def _ms(ms: float | None) -> str:
    return f"{ms:8.3f}" if ms is not None else f"{'-':>8s}"


_HEADER_CORE = (f"{'#':>2s}  {'signature':44s} {'calls':>5s} {'TFLOP':>7s} | {'torch ms':>8s} {'TF/s':>5s} "
                f"{'backend':10s} | {'plan0 ms':>8s} | {'best ms':>8s} {'TF/s':>5s} {'speedup':>7s} {'ok/tried':>8s} "
                f"{'err':>7s}")
HEADER = _HEADER_CORE + "  best plan"
# --triton: the best Triton config's columns, before the best plan's (long) name
TRITON_HEADER = f" | {'triton':>8s} {'TF/s':>5s} {'speedup':>7s} {'ok/tried':>8s} {'err':>7s} {'config':16s}"


def header(triton: bool = False) -> str:
    return _HEADER_CORE + (TRITON_HEADER if triton else "") + "  best plan"


def shape_line(k: int, r: ShapeResult, max_err: float, triton: bool = False) -> str:
    best, p0 = r.best_plan(), r.plan0()
    speed = f"{r.torch_ms / best.ms:6.2f}x" if best and best.ms and r.torch_ms else f"{'-':>7s}"
    err = f"{best.rel_err:7.4f}" if best and best.rel_err is not None else f"{'-':>7s}"
    tried = f"{r.n_ok(max_err)}/{len(r.plans)}"
    line = (f"{k:2d}  {r.sig.label():44s} {r.calls:5d} {r.tflop:7.4f} | {_ms(r.torch_ms)} "
            f"{tflops(r.tflop, r.torch_ms):5.0f} {r.torch_backend:10s} | {_ms(p0.ms if p0 else None)} | "
            f"{_ms(best.ms if best else None)} {tflops(r.tflop, best.ms if best else None):5.0f} {speed} "
            f"{tried:>8s} {err}")
    if triton:
        line += triton_columns(r, max_err)
    return f"{line}  {best.name if best else '-'}"


def triton_columns(r: ShapeResult, max_err: float) -> str:
    """TRITON_HEADER's columns: the best Triton config's ms, TFLOP/s, speedup over torch, configs
    within --max-err / tried, its error and name."""
    best = r.best_triton()
    ms = best.ms if best else None
    speed = f"{r.torch_ms / ms:6.2f}x" if ms and r.torch_ms else f"{'-':>7s}"
    err = f"{best.rel_err:7.4f}" if best and best.rel_err is not None else f"{'-':>7s}"
    tried = f"{sum(p.ok(max_err) for p in r.triton)}/{len(r.triton)}"
    return f" | {_ms(ms)} {tflops(r.tflop, ms):5.0f} {speed} {tried:>8s} {err} {best.name if best else '-':16s}"


def shape_notes(r: ShapeResult, max_err: float, max_plans: int = 6) -> list[str]:
    """The errors under a shape's line: torch's, the graph's, and the first `max_plans` plans that
    did not count (all of them are in --json)."""
    notes = []
    if r.sig.bias:
        notes.append("recorded with a bias (timed without)")
    if r.torch_error:
        notes.append(f"torch: {r.torch_error}")
    if r.graph_error:
        notes.append(f"cudnn frontend: {r.graph_error}")
    if r.build_error:
        notes.append(f"cudnn frontend: {r.build_error} (plans then built one by one)")
    if r.triton_skip:
        notes.append(f"triton: not run ({r.triton_skip})")
    for p in r.triton:  # a handful of configs: all listed
        if (why := p.why_not_counted(max_err)) is not None:
            notes.append(f"triton {p.name}: {why}")
    for p in r.plans:
        if (why := p.why_not_counted(max_err)) is not None:
            notes.append(f"plan {p.index} {p.name}: {why}")
    head = [n for n in notes if not n.startswith("plan ")]
    plans = notes[len(head):]
    more = [f"... {len(plans) - max_plans} more failed plans (see --json)"] if len(plans) > max_plans else []
    return head + plans[:max_plans] + more


def chunk_totals(results: list[ShapeResult], triton: bool = False) -> dict[str, float]:
    """Per-chunk conv ms (sum of ms x calls) for torch, plan 0, the best plans and the best of both;
    a shape without a plan that ran counts at torch's ms in the cuDNN columns. With ``triton`` also
    the best Triton configs (``best_triton``, torch's ms where none ran within --max-err) and the
    best of torch, plans and Triton (``best_of_all``)."""
    tot = {"torch": 0.0, "plan0": 0.0, "best_plan": 0.0, "best_of_both": 0.0}
    if triton:
        tot |= {"best_triton": 0.0, "best_of_all": 0.0}
    for r in results:
        if r.torch_ms is None:
            continue
        p0, best = r.plan0(), r.best_plan()
        best_ms = best.ms if best and best.ms is not None else r.torch_ms
        p0_ms = p0.ms if p0 and p0.ms is not None else r.torch_ms
        tot["torch"] += r.torch_ms * r.calls
        tot["plan0"] += p0_ms * r.calls
        tot["best_plan"] += best_ms * r.calls
        tot["best_of_both"] += min(best_ms, r.torch_ms) * r.calls
        if triton:
            tri = r.best_triton()
            tri_ms = tri.ms if tri and tri.ms is not None else r.torch_ms
            tot["best_triton"] += tri_ms * r.calls
            tot["best_of_all"] += min(best_ms, r.torch_ms, tri_ms) * r.calls
    return tot


def print_summary(
    results: list[ShapeResult], video_chunks: int, max_err: float, triton: bool = False
) -> dict[str, Any]:
    tot = chunk_totals(results, triton)
    saving = tot["torch"] - tot["best_of_both"]
    faster = [(r, b) for r in results if (b := r.best_plan()) and b.ms and r.torch_ms and b.ms < 0.95 * r.torch_ms]
    calls = sum(r.calls for r in results)
    print(f"\n========== summary: {len(results)} unique convs, {calls} calls per steady chunk ==========")
    print(f"per chunk, conv GPU ms (sum of ms x calls): torch {tot['torch']:.3f}, heuristic plan 0 {tot['plan0']:.3f}, "
          f"best plan {tot['best_plan']:.3f}, best of torch and plans {tot['best_of_both']:.3f}")
    pct = 100 * saving / tot["torch"] if tot["torch"] else math.nan
    print(f"projected saving: {saving:.3f} ms per chunk ({pct:.1f} % of torch's conv time), "
          f"{saving * video_chunks:.1f} ms per {video_chunks}-chunk video")
    print(f"shapes where the best plan (rel err <= {max_err}) is >= 5 % faster than torch: {len(faster)}"
          + "".join(f"\n  {r.sig.label()} x{r.calls}: {r.torch_ms:.3f} -> {b.ms:.3f} ms ({b.name})" for r, b in faster))
    no_plan = [r for r in results if r.best is None]
    if no_plan:
        print(f"shapes with no usable cuDNN-frontend plan (counted at torch's ms): {len(no_plan)}")
    summary = {"per_chunk_ms": tot, "saving_per_chunk_ms": saving, "video_chunks": video_chunks,
               "saving_per_video_ms": saving * video_chunks, "faster_shapes": len(faster)}
    if triton:
        summary |= print_triton_summary(results, tot, video_chunks, max_err)
    return summary


def print_triton_summary(
    results: list[ShapeResult], tot: dict[str, float], video_chunks: int, max_err: float
) -> dict[str, Any]:
    """The --triton lines of the summary: Triton's total, the best of torch, plans and Triton, and
    the shapes where Triton beats both by 5 %; the summary's extra --json keys."""
    saving = tot["torch"] - tot["best_of_all"]
    over_both = tot["best_of_both"] - tot["best_of_all"]
    pct = 100 * saving / tot["torch"] if tot["torch"] else math.nan
    print(f"with triton: best Triton config {tot['best_triton']:.3f}, best of torch, plans and triton "
          f"{tot['best_of_all']:.3f} ms per chunk; saving {saving:.3f} ms per chunk ({pct:.1f} % of torch's), "
          f"{saving * video_chunks:.1f} ms per {video_chunks}-chunk video, {over_both:.3f} ms per chunk over "
          "the best of torch and plans")
    wins = []
    for r in results:
        tri, best = r.best_triton(), r.best_plan()
        rivals = [ms for ms in (r.torch_ms, best.ms if best else None) if ms is not None]
        if tri and tri.ms and rivals and tri.ms < 0.95 * min(rivals):
            wins.append((r, tri, min(rivals)))
    print(f"shapes where the best Triton config (rel err <= {max_err}) is >= 5 % faster than torch and every plan: "
          f"{len(wins)}" + "".join(f"\n  {r.sig.label()} x{r.calls}: {ms:.3f} -> {t.ms:.3f} ms ({t.name})"
                                   for r, t, ms in wins))
    skipped = [r for r in results if r.triton_skip]
    if skipped:
        print(f"shapes the Triton conv does not take (counted at torch's ms): {len(skipped)}")
    failed = [r for r in results if r.torch_ms is not None and not r.triton_skip and r.triton_best is None]
    if failed:
        print(f"shapes where no Triton config ran within --max-err (counted at torch's ms): {len(failed)}")
    return {"saving_with_triton_per_chunk_ms": saving, "saving_with_triton_per_video_ms": saving * video_chunks,
            "triton_saving_over_best_of_both_per_chunk_ms": over_both, "triton_faster_shapes": len(wins)}


def result_json(r: ShapeResult, triton: bool = False) -> dict[str, Any]:
    d = dataclasses.asdict(r)
    d["label"] = r.sig.label()
    d["out_spatial"] = r.sig.out_spatial()
    d["torch_tflops"] = tflops(r.tflop, r.torch_ms)
    best = r.best_plan()
    d["best_plan_name"] = best.name if best else None
    d["best_ms"] = best.ms if best else None
    d["best_tflops"] = tflops(r.tflop, best.ms if best else None)
    if not triton:  # the file a run without --triton wrote before the column existed
        for key in ("triton", "triton_best", "triton_skip"):
            del d[key]
        return d
    tri = r.best_triton()
    d["triton_best_config"] = tri.name if tri else None
    d["triton_best_ms"] = tri.ms if tri else None
    d["triton_best_tflops"] = tflops(r.tflop, tri.ms if tri else None)
    return d


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def parse_hw(text: str) -> tuple[int, int]:
    try:
        h, w = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected H,W (e.g. 60,104), got {text!r}") from None
    return h, w


def default_latent(model: str) -> tuple[int, int]:
    scale = RANDOM_CONFIGS[model].get("scale_factor_spatial", 8)
    return VIDEO_SIZE[0] // scale, VIDEO_SIZE[1] // scale


def triton_version() -> str:
    try:
        import triton
    except Exception as exc:  # noqa: BLE001 - a broken install raises its own errors at import
        return f"? ({error_text(exc, 80)})"
    return str(triton.__version__)


def check_environment(heuristics: str) -> Frontend | str:
    """The frontend, or why this machine cannot run the benchmark."""
    if not torch.cuda.is_available():
        return "needs CUDA: run it on the GPU machine"
    try:
        return Frontend.open(heuristics)
    except ImportError as exc:
        return f"needs the cuDNN frontend: pip install nvidia-cudnn-frontend ({error_text(exc, 120)})"
    except AttributeError as exc:
        return f"unknown --heuristics mode in {heuristics!r}: {exc}"
    except Exception as exc:  # noqa: BLE001 - e.g. no libcudnn for the frontend to load
        return f"the cuDNN frontend did not start: {error_text(exc)}"


def run_environment(versions: dict[str, Any]) -> dict[str, Any]:
    """What a --json file records of the machine: torch, cuDNN (torch's and the frontend's),
    the GPU and torch's cudnn.benchmark flag."""
    return {"torch": torch.__version__, "cudnn_torch": torch.backends.cudnn.version(), **versions,
            "device": torch.cuda.get_device_name(0), "cudnn_benchmark": torch.backends.cudnn.benchmark}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="wan2.1", choices=sorted(RANDOM_CONFIGS),
                        help="random-weight architecture (vaed.models.RANDOM_CONFIGS)")
    parser.add_argument("--tier", default="fast", choices=("fast", "lossless"), help="op set the decode runs under")
    parser.add_argument("--latent", type=parse_hw, default=None,
                        help="latent H,W (default: 480x832 over the model's spatial scale, 60,104 for wan2.1)")
    parser.add_argument("--frames", type=int, default=3,
                        help="latent frames decoded; the last one's convs are recorded")
    parser.add_argument("--iters", type=int, default=20, help="timed launches per conv and plan (median reported)")
    parser.add_argument("--heuristics", default=DEFAULT_HEURISTICS,
                        help="cudnn.heur_mode names, comma separated (A, B, FALLBACK)")
    parser.add_argument("--max-err", type=float, default=DEFAULT_MAX_ERR,
                        help="a plan counts as best only within this max |plan - torch| / max |torch|")
    parser.add_argument("--video-chunks", type=int, default=VIDEO_CHUNKS, help="chunks per video for the projection")
    parser.add_argument("--json", metavar="PATH", help="write the per-shape results and the summary here")
    parser.add_argument("--triton", action="store_true",
                        help="also time benchmarks/triton_conv.py's implicit-GEMM conv (each config, checked like a "
                             "plan) on the signatures it takes")
    args = parser.parse_args(argv)
    if args.frames < 2:
        parser.error("--frames must be >= 2 (the recorded frame must be a steady chunk)")
    fe = check_environment(args.heuristics)
    if isinstance(fe, str):
        print(fe, file=sys.stderr)
        return 2
    hw = args.latent or default_latent(args.model)
    versions = fe.versions()
    print(f"torch {torch.__version__}, cuDNN (torch) {torch.backends.cudnn.version()}, cudnn frontend "
          f"{versions['frontend']} (backend {versions['backend']}), {torch.cuda.get_device_name(0)}, "
          f"cudnn.benchmark={torch.backends.cudnn.benchmark}" + (f", triton {triton_version()}" if args.triton else ""))

    vae, ops = build_decoder(args.model, args.tier)
    z = latents_for(vae, hw, args.frames)
    counts = record_steady_chunk(vae, z, ops)
    del vae, z, ops
    gc.collect()
    torch.cuda.empty_cache()
    print(f"{args.model} {args.tier}, latent {args.frames}x{hw[0]}x{hw[1]}: {len(counts)} unique convs, "
          f"{sum(counts.values())} calls in the last (steady) chunk; heuristics {args.heuristics}, "
          f"median of {args.iters} launches", flush=True)

    results = []
    for i, (sig, calls) in enumerate(counts.items()):
        t0 = time.perf_counter()
        results.append(measure_shape(fe, sig, calls, args.iters, args.max_err, args.triton))
        torch.cuda.empty_cache()
        # a shape builds and times every plan: seconds each, so say where the run is
        print(f"  [{i + 1}/{len(counts)}] {sig.label()} measured in {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    results.sort(key=lambda r: -(r.torch_ms or 0.0) * r.calls)
    print("\n" + header(args.triton))
    for k, r in enumerate(results):
        print(shape_line(k, r, args.max_err, args.triton))
        for note in shape_notes(r, args.max_err):
            print(f"      {note}")
    summary = print_summary(results, args.video_chunks, args.max_err, args.triton)
    if args.json:
        env = run_environment(versions)
        run_args = vars(args) | {"latent": list(hw)}
        if args.triton:
            env["triton"] = triton_version()
        else:  # the file a run without --triton wrote before the flag existed
            del run_args["triton"]
        out = {"env": env, "args": run_args, "shapes": [result_json(r, args.triton) for r in results],
               "summary": summary}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
