"""Can a cuDNN graph add a conv's bias inside the conv and still give stock's bits?

Stock runs a cuDNN conv, rounds its output to bf16, then adds the bias in an aten pass of
its own (a second rounding). The lossless tier reproduces that pass wherever its reader
cannot take the bias (conv1 -> norm2: aten's norm reduction reads the biased tensor), and
the pass costs a read and a write of the whole conv output. A frontend graph
``conv_fprop -> (virtual, bf16) -> bias -> bf16`` would give stock's bits if the engine
(a) sums each output in torch's order, as many plain engines do, and (b) honours the
virtual tensor's bf16 type (rounds before the bias). This measures both on the decoder's
own conv signatures (the steady chunk of the lossless tier, recorded as ``bench_convs.py``
does), per signature:

* ``torch+add``: torch's conv without bias, then aten's ``add_`` of the bias (stock's pair);
* ``exact``: plans of the fused graph whose output has stock's bits (integer views) on
  ``--inputs`` seeded inputs, out of all plans built; ``best``: the fastest of them;
* ``f32 exact``: the same count for the graph with an fp32 virtual tensor (one rounding),
  which should be near zero: it shows that the bf16 rounding is what makes a plan exact.

Totals per steady chunk weigh each signature by its calls. Timing is
``conv_plans.gpu_ms`` (median of ``--iters`` launches, each behind a GPU sleep).

    python benchmarks/exact_conv_bias.py --model wan2.2 --latent 44,80
"""

from __future__ import annotations

import argparse
import functools
import gc
import sys
from dataclasses import dataclass, field
from typing import Any

import bench_convs as bc
import torch
from bench_conv_epilogues import broadcast_bias, fe_dtype

from vaed.patches.bits import same_bits
from vaed.patches.conv_plans import gpu_ms


@dataclass
class SigResult:
    sig: bc.ConvSig
    calls: int
    torch_add_ms: float | None = None
    plans: int = 0
    exact: list[tuple[float, str]] = field(default_factory=list)  # (ms, plan name) of exact plans
    f32_exact: int = 0
    f32_plans: int = 0
    error: str | None = None

    @property
    def best_ms(self) -> float | None:
        return min(ms for ms, _ in self.exact) if self.exact else None


def fused_graph(fe: bc.Frontend, sig: bc.ConvSig, x: torch.Tensor, w: torch.Tensor, bb: torch.Tensor,
                y: torch.Tensor, virtual_dtype: torch.dtype) -> tuple[Any, dict]:
    """The built graph conv -> (virtual ``virtual_dtype``) -> bias over these buffers, and its pack."""
    cudnn = fe.cudnn
    io = fe_dtype(fe, sig.torch_dtype)
    f32 = cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=fe.handle)
    X = graph.tensor(name="X", dim=list(x.shape), stride=list(x.stride()), data_type=io)
    W = graph.tensor(name="W", dim=list(w.shape), stride=list(w.stride()), data_type=io)
    B = graph.tensor(name="B", dim=list(bb.shape), stride=list(bb.stride()), data_type=io)
    conv = graph.conv_fprop(image=X, weight=W, padding=list(sig.padding), stride=list(sig.stride),
                            dilation=list(sig.dilation), compute_data_type=f32, name="conv")
    conv.set_data_type(fe_dtype(fe, virtual_dtype))
    out = graph.bias(input=conv, bias=B, compute_data_type=f32, name="bias")
    out.set_output(True).set_data_type(io).set_dim(list(y.shape)).set_stride(list(y.stride()))
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans(fe.heuristics)
    graph.check_support()
    try:
        graph.build_plans(cudnn.build_plan_policy.ALL)
    except Exception:  # some versions give up on all plans for one
        bc.build_each(graph)
    return graph, {X: x, W: w, B: bb, out: y}


def stock_pair(sig: bc.ConvSig, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = bc.torch_conv(sig, x, w)()
    return y.add_(b.view(1, -1, *([1] * (y.dim() - 2))))


def exact_plans(fe: bc.Frontend, sig: bc.ConvSig, inputs: list[tuple], virtual_dtype: torch.dtype,
                iters: int) -> tuple[int, list[tuple[float, str]]]:
    """(plans built, [(ms, name)] of the plans with stock's bits on every input; timed only if
    ``iters``). The graph reads its own buffers, refilled from each input."""
    x0, w0, b0, want0 = inputs[0]
    xb, wb = torch.empty_like(x0), torch.empty_like(w0)  # empty_like keeps a dense tensor's strides
    bb = broadcast_bias(torch.empty_like(b0), x0.dim())
    y = torch.empty_like(want0)
    graph, pack = fused_graph(fe, sig, xb, wb, bb, y, virtual_dtype)
    n = bc.plan_count(graph)
    found = []
    for i in range(n):
        try:
            ws = torch.empty(max(int(graph.get_workspace_size_plan_at_index(i)), 1), dtype=torch.uint8,
                             device=bc.DEVICE)
            ok = True
            for x, w, b, want in inputs:
                xb.copy_(x)
                wb.copy_(w)
                bb.copy_(broadcast_bias(b, x.dim()))
                y.fill_(float("nan"))
                bc.execute_plan(fe, graph, pack, ws, i)
                torch.cuda.synchronize()
                if not same_bits(y, want):
                    ok = False
                    break
            if ok:
                ms = gpu_ms(functools.partial(bc.execute_plan, fe, graph, pack, ws, i), iters) if iters else 0.0
                found.append((ms, bc.plan_name(graph, i)))
        except Exception:  # a plan that does not build or run is not a candidate
            continue
    return n, found


def measure(fe: bc.Frontend, sig: bc.ConvSig, calls: int, n_inputs: int, iters: int) -> SigResult:
    res = SigResult(sig, calls)
    try:
        inputs = []
        for seed in range(n_inputs):
            torch.manual_seed(seed)
            x, w = bc.conv_tensors(sig)
            b = torch.randn(sig.w_shape[0], device=bc.DEVICE, dtype=sig.torch_dtype) * 0.1
            inputs.append((x, w, b, stock_pair(sig, x, w, b)))
        x, w, b, _ = inputs[0]
        res.torch_add_ms = gpu_ms(lambda: stock_pair(sig, x, w, b), iters)
        res.plans, res.exact = exact_plans(fe, sig, inputs, sig.torch_dtype, iters)
        res.f32_plans, f32 = exact_plans(fe, sig, inputs, torch.float32, 0)
        res.f32_exact = len(f32)
    except Exception as exc:
        res.error = bc.error_text(exc)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="wan2.2")
    p.add_argument("--latent", type=bc.parse_hw, default=None, help="latent H,W (default: the model's 480p/704p)")
    p.add_argument("--frames", type=int, default=3)
    p.add_argument("--inputs", type=int, default=2, help="seeded inputs a plan must match on")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--heuristics", default=bc.DEFAULT_HEURISTICS)
    p.add_argument("--biased-only", action="store_true", help="only signatures recorded with a bias")
    args = p.parse_args(argv)
    fe = bc.check_environment(args.heuristics)
    if isinstance(fe, str):
        print(fe, file=sys.stderr)
        return 2
    hw = args.latent or bc.default_latent(args.model)
    vae, ops = bc.build_decoder(args.model, "lossless")
    counts = bc.record_steady_chunk(vae, bc.latents_for(vae, hw, args.frames), ops)
    del vae, ops
    gc.collect()
    torch.cuda.empty_cache()
    sigs = [(s, n) for s, n in counts.items() if not isinstance(s.padding, str) and (s.bias or not args.biased_only)]
    sigs.sort(key=lambda sn: -sn[0].flop() * sn[1])
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {fe.versions()}; "
          f"{args.model} latent {hw}, {len(sigs)} signatures")
    print(f"{'#':>2} {'conv':<58} {'calls':>5} {'bias':>4} {'torch+add':>9} {'best':>7} {'exact':>9} "
          f"{'f32 exact':>9}  best plan")
    total_torch = total_best = 0.0
    for k, (sig, n) in enumerate(sigs):
        r = measure(fe, sig, n, args.inputs, args.iters)
        if r.error:
            print(f"{k:>2} {sig.label():<58} {n:>5} error: {r.error}")
            continue
        best = r.best_ms
        name = min(r.exact)[1] if r.exact else "-"
        t = r.torch_add_ms or 0.0
        total_torch += t * n
        total_best += min(t, best if best is not None else t) * n
        best_text = f"{best:7.3f}" if best is not None else "      -"
        print(f"{k:>2} {sig.label():<58} {n:>5} {'y' if sig.bias else 'n':>4} {t:9.3f} {best_text} "
              f"{len(r.exact):>4}/{r.plans:<4} {r.f32_exact:>4}/{r.f32_plans:<4}  {name}")
        sys.stdout.flush()
        torch.cuda.empty_cache()
    print(f"per steady chunk: torch conv + aten bias add {total_torch:.2f} ms; with the fastest exact fused plan "
          f"where one wins {total_best:.2f} ms (saves {total_torch - total_best:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
