"""The tuned cuDNN conv plans (vaed.patches.conv_plans): the fast tier's, and the lossless tier's
with torch's bits.

CPU: the call signature, the choice rule, the plan file, the registry per rule, and that without
a planner every conv op is torch's. CUDA (the H200): tuning real decoder shapes under both
rules, replaying from the file, the exact rule refusing a plan the tolerance takes, capture in a
CUDA graph, and an engine's fast decode on plans while its lossless decode runs on exact plans
and stays stock's bits.
"""

from __future__ import annotations

import json
import math
import types
from typing import Any

import pytest
import torch
from torch import nn

from vaed.choices import ConvPlans, Precision
from vaed.patches import FAST_OPS, LOSSLESS_OPS, REFERENCE_OPS
from vaed.patches import conv_plans as CP
from vaed.patches.bits import same_bits
from vaed.patches.conv_plans import conv_with_plan
from vaed.startup import CONV_PLAN_FILE

CUDA = torch.cuda.is_available()
cuda = [pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
CL3D = torch.channels_last_3d


def _call(**over: Any) -> CP.ConvCall:
    x = torch.empty(1, 8, 4, 6, 10).contiguous(memory_format=CL3D)
    w = torch.empty(16, 8, 3, 3, 3).contiguous(memory_format=CL3D)
    base = CP.ConvCall.of(x.bfloat16(), w.bfloat16(), 1, (0, 1, 1), 1, 1)
    assert base is not None
    return CP.ConvCall(**{**base.__dict__, **over})


def test_call_records_what_torch_is_asked_and_round_trips_through_its_key() -> None:
    call = _call()
    assert call.x_stride == torch.empty(1, 8, 4, 6, 10).contiguous(memory_format=CL3D).stride()
    assert (call.stride, call.padding, call.dilation, call.groups, call.dtype) == ((1, 1, 1), (0, 1, 1), (1, 1, 1), 1,
                                                                                 "bfloat16")
    assert CP.ConvCall.from_key(call.key()) == call
    assert call.out_shape() == (1, 16, 2, 6, 10)
    assert call.label() == "conv3d 8->16 k3x3x3 in 1x8x4x6x10"
    # the shape out_shape predicts is torch's
    x, w = torch.randn(call.x_shape), torch.randn(call.w_shape)
    assert tuple(torch.nn.functional.conv3d(x, w, None, call.stride, call.padding).shape) == call.out_shape()
    with pytest.raises(ValueError, match="not a conv call"):
        CP.ConvCall.from_key("[1, 2]")


def test_call_declines_what_a_plan_does_not_take() -> None:
    x, w = torch.empty(1, 4, 5, 7, dtype=torch.bfloat16), torch.empty(4, 4, 3, 3, dtype=torch.bfloat16)
    assert CP.ConvCall.of(x, w, padding="same") is None
    assert CP.ConvCall.of(x.to(torch.int8), w.to(torch.int8)) is None
    assert CP.ConvCall.of(x, w) is not None


@pytest.mark.parametrize("torch_ms,plans,want", [
    (1.0, [(0.90, 0.001), (0.80, 0.001)], 1),  # the fastest that qualifies
    (1.0, [(0.99, 0.001)], None),  # under MIN_GAIN: torch stays
    (1.0, [(0.50, 0.5), (0.90, 0.001)], 1),  # the fastest is off torch's output
    (1.0, [(0.50, math.nan)], None),  # NaN never qualifies
    (1.0, [(math.inf, 0.001)], None),  # not timed (it failed its check)
    (1.0, [], None),
])
def test_choose_takes_the_fastest_accurate_plan_that_beats_torch(
    torch_ms: float, plans: list[tuple[float, float]], want: int | None
) -> None:
    assert CP.choose(torch_ms, plans) == want


def test_choose_forced_takes_any_plan_that_runs() -> None:
    assert CP.choose(0.1, [(0.9, 0.001), (0.5, 0.001)], min_gain=-math.inf) == 1
    assert CP.choose(0.1, [(0.5, 0.5)], min_gain=-math.inf) is None


def test_plan_file_keeps_other_fingerprints_and_ignores_a_foreign_one(tmp_path: Any) -> None:
    tmp_path = tmp_path / "kernel-cache"  # not made yet: the first write makes it
    f = CP.PlanFile(str(tmp_path / CONV_PLAN_FILE))
    assert f.read({"gpu": "A"}) == {}  # absent
    call, other = _call(), _call(groups=2)
    chosen = CP.PlanChoice(7, ((1, 2), (3, 4)), (480, 1, 160, 16, 16), 1.25, 1.0, "eng7_k1=2")
    kept = CP.PlanChoice(None, (), (1, 2, 3, 4, 5), 0.5, None, "torch")
    f.write({"gpu": "A"}, {call: chosen, other: kept})
    f.write({"gpu": "B"}, {call: kept})
    assert f.read({"gpu": "A"}) == {call: chosen, other: kept}
    assert f.read({"gpu": "B"}) == {call: kept}
    assert f.read({"gpu": "C"}) == {}
    f.write({"gpu": "A"}, {other: chosen})  # replaces A's, keeps B's
    assert f.read({"gpu": "A"}) == {other: chosen}
    assert f.read({"gpu": "B"}) == {call: kept}
    doc = json.loads((tmp_path / CONV_PLAN_FILE).read_text())
    assert doc["format"] == CP.FILE_FORMAT and len(doc["fingerprints"]) == 2
    assert not list(tmp_path.glob("*.tmp"))


def test_plan_file_of_another_format_or_broken_is_empty(tmp_path: Any, caplog: Any) -> None:
    path = tmp_path / CONV_PLAN_FILE
    path.write_text(json.dumps({"format": CP.FILE_FORMAT + 1, "fingerprints": [{"fingerprint": {}, "plans": {}}]}))
    assert CP.PlanFile(str(path)).read({}) == {}
    path.write_text("{not json")
    assert CP.PlanFile(str(path)).read({}) == {}
    assert "cannot read" in caplog.text
    # one bad entry is skipped, the others are read
    good = _call()
    path.write_text(json.dumps({"format": CP.FILE_FORMAT, "fingerprints": [{"fingerprint": {}, "plans": {
        good.key(): {"engine_id": 3, "knobs": [], "y_stride": [1], "torch_ms": 1.0, "plan_ms": 0.5},
        "[1]": {"engine_id": 3},
    }}]}))
    assert list(CP.PlanFile(str(path)).read({})) == [good]


def test_without_a_planner_the_fast_convs_are_torchs() -> None:
    assert CP.planner_for(torch.device("cpu")) is None
    conv3 = nn.Conv3d(4, 6, 3)
    x = torch.randn(1, 4, 3, 5, 7)
    assert torch.equal(FAST_OPS.conv3d(conv3, x), REFERENCE_OPS.conv3d(conv3, x))
    assert torch.equal(FAST_OPS.conv3d(conv3, x, bias=False), REFERENCE_OPS.conv3d(conv3, x, bias=False))
    conv2 = nn.Conv2d(4, 4, 3, padding=1)
    img = torch.randn(2, 4, 5, 7)
    assert torch.equal(FAST_OPS.conv2d(conv2, img), REFERENCE_OPS.conv2d(conv2, img))
    assert torch.equal(FAST_OPS.conv2d(conv2, img, bias=False), REFERENCE_OPS.conv2d(conv2, img, bias=False))
    # the lossless tier's convs ask the exact planner alone; without one they are torch's, bit for bit
    for bias in (True, False):
        assert same_bits(LOSSLESS_OPS.conv3d(conv3, x, bias=bias), REFERENCE_OPS.conv3d(conv3, x, bias=bias))
        assert same_bits(LOSSLESS_OPS.conv2d(conv2, img, bias=bias), REFERENCE_OPS.conv2d(conv2, img, bias=bias))
    for ops in (FAST_OPS, LOSSLESS_OPS):
        assert {"conv3d", "conv2d"} <= set(ops.differs_from_reference())
        assert ops.without({"conv3d"}).conv3d is REFERENCE_OPS.conv3d  # --disable-op conv3d


def test_conv2d_with_hooks_stays_the_module_call() -> None:
    conv2 = nn.Conv2d(4, 4, 3, padding=1)
    conv2.register_forward_hook(lambda _m, _i, out: out * 0)
    img = torch.randn(1, 4, 5, 7)
    assert torch.count_nonzero(FAST_OPS.conv2d(conv2, img)) == 0
    assert torch.count_nonzero(LOSSLESS_OPS.conv2d(conv2, img)) == 0


def test_registry_routes_cuda_calls_only_and_uninstall_removes_it() -> None:
    asked: list[CP.ConvCall] = []
    device = torch.device("cpu")
    CP.install(types.SimpleNamespace(device=device, exact=False,  # type: ignore[arg-type]
                                     run=lambda call, x, w: asked.append(call)))
    try:
        assert CP.planner_for(device) is not None
        x, w = torch.randn(1, 4, 5, 7), torch.randn(4, 4, 3, 3)
        # planned_conv consults planners for CUDA tensors alone: a CPU conv is torch's
        assert CP.planned_conv(x, w, 1, 1) is None
        assert torch.equal(conv_with_plan(x, w, None, 1, 1), torch.nn.functional.conv2d(x, w, None, 1, 1))
        assert asked == []
    finally:
        CP.uninstall(device)
    assert CP.planner_for(device) is None


def test_registry_keeps_one_planner_per_rule() -> None:
    device = torch.device("cpu")
    fast = types.SimpleNamespace(device=device, exact=False)
    exact = types.SimpleNamespace(device=device, exact=True)
    CP.install(fast)  # type: ignore[arg-type]
    CP.install(exact)  # type: ignore[arg-type]
    try:
        assert CP.planner_for(device) is fast and CP.planner_for(device, exact=True) is exact
        CP.uninstall(device, exact=True)
        assert CP.planner_for(device) is fast and CP.planner_for(device, exact=True) is None
    finally:
        CP.uninstall(device)
        CP.uninstall(device, exact=True)
    assert CP.planner_for(device) is None


def test_a_plan_takes_only_aligned_operands() -> None:
    x = torch.empty(64, dtype=torch.bfloat16)
    assert CP.aligned(x, x[8:]) and not CP.aligned(x, x[1:]) and not CP.aligned(x[4:])


def test_open_refuses_a_cpu_device() -> None:
    assert isinstance(CP.ConvPlanner.open(torch.device("cpu"), None), str)
    assert isinstance(CP.ConvPlanner.open(torch.device("cpu"), None, exact=True), str)


# --- CUDA ----------------------------------------------------------------------------------------

# Real decoder conv shapes at a small latent size (Wan2.1, bf16, channels_last_3d), a time tap
# each: a 384-channel 3x3x3 conv, a 192->384 one, the unfolded 288->96 conv2d, a 1x1x1 shortcut.
def _decoder_calls() -> list[tuple[torch.Tensor, torch.Tensor, Any]]:
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for c_in, c_out, k, dims in ((384, 384, 3, (3, 30, 52)), (192, 384, 3, (3, 30, 52)), (384, 192, 1, (1, 30, 52))):
        x = torch.randn(1, c_in, *dims, generator=g, device="cuda", dtype=torch.bfloat16).contiguous(memory_format=CL3D)
        w = (torch.randn(c_out, c_in, k, k, k, generator=g, device="cuda", dtype=torch.bfloat16)
             / (c_in * k**3) ** 0.5).contiguous(memory_format=CL3D)
        out.append((x, w, (0, 1, 1) if k == 3 else 0))
    img = torch.randn(1, 288, 62, 106, generator=g, device="cuda", dtype=torch.bfloat16).contiguous(
        memory_format=torch.channels_last)
    w2 = (torch.randn(96, 288, 3, 3, generator=g, device="cuda", dtype=torch.bfloat16) / 2592**0.5).contiguous(
        memory_format=torch.channels_last)
    out.append((img, w2, 0))
    return out


def _open(tmp_path: Any, exact: bool = False) -> CP.ConvPlanner:
    planner = CP.ConvPlanner.open(torch.device("cuda", torch.cuda.current_device()),
                                  CP.PlanFile(str(tmp_path / CONV_PLAN_FILE)), exact=exact)
    if isinstance(planner, str):
        pytest.skip(planner)  # the frontend is not installed: the feature is off, as in a server
    return planner


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@torch.inference_mode()
def test_cuda_tuned_plans_are_accurate_and_replay_from_the_file_bit_for_bit(tmp_path: Any) -> None:
    planner = _open(tmp_path)
    convs = _decoder_calls()
    calls = []
    for x, w, pad in convs:
        call = CP.ConvCall.of(x, w, 1, pad)
        assert call is not None
        assert planner.run(call, x, w) is None  # no choice yet: recorded, torch runs it
        calls.append(call)
    assert set(calls) == planner.unplanned
    # out of time before the first call: nothing timed, everything left for a later start
    report = planner.tune(min_gain=-math.inf, seconds=-1.0)
    assert (report.calls, report.left, report.planned) == (0, len(calls), 0)
    assert planner.unplanned == set(calls) and planner.choices == {}
    report = planner.tune(min_gain=-math.inf)  # a plan wherever one runs, to exercise every path
    assert (report.calls, report.left, report.planned) == (len(calls), 0, len(calls)), report.failed
    assert not planner.unplanned
    firsts = []
    for call, (x, w, _) in zip(calls, convs, strict=True):
        choice = planner.choices[call]
        assert choice.engine_id is not None and choice.plan_ms is not None and choice.plan_ms > 0
        y = planner.run(call, x, w)
        want = call.run_torch(x, w)
        assert y is not None and y.shape == want.shape and y.stride() == want.stride()
        assert CP._rel_err(y, want) <= CP.MAX_REL_ERR
        firsts.append(y.clone())
    # a restart: a new planner reads the file and replays the same plans, the same bits
    again = _open(tmp_path)
    assert again.choices == planner.choices
    for call, (x, w, _), first in zip(calls, convs, firsts, strict=True):
        y = again.run(call, x, w)
        assert y is not None and torch.equal(y, first), call.label()


def _fresh(call: CP.ConvCall, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Operands of the call's layouts from another generator than the planner's verdict inputs."""
    g = torch.Generator(device="cuda").manual_seed(1000 + seed)
    x = torch.empty_strided(call.x_shape, call.x_stride, dtype=torch.bfloat16, device="cuda")
    w = torch.empty_strided(call.w_shape, call.w_stride, dtype=torch.bfloat16, device="cuda")
    x.copy_(torch.randn(call.x_shape, generator=g, device="cuda") * 2)
    w.copy_(torch.randn(call.w_shape, generator=g, device="cuda") / math.prod(call.w_shape[1:]) ** 0.5)
    return x, w


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@torch.inference_mode()
def test_cuda_exact_plans_give_torchs_bits_and_keep_their_own_fingerprint(tmp_path: Any) -> None:
    exact = _open(tmp_path, exact=True)
    assert exact.fingerprint["rule"] == "exact" and "rule" not in _open(tmp_path).fingerprint
    calls = [CP.ConvCall.of(x, w, 1, pad) for x, w, pad in _decoder_calls()]
    assert all(c is not None for c in calls)
    report = exact.tune(calls, min_gain=-math.inf)  # a plan wherever one has torch's bits
    assert report.calls == len(calls), report.failed
    planned = [c for c in calls if c is not None and exact.choices[c].engine_id is not None]
    assert planned, exact.choices  # on the H200 most engines sum these convs in torch's order
    for call in planned:
        for seed in range(3):
            x, w = _fresh(call, seed)
            y = exact.run(call, x, w)
            assert y is not None and same_bits(y, call.run_torch(x, w)), call.label()
    # the fast planner's section of the same file is its own: empty, and the exact one survives its write
    fast = _open(tmp_path)
    assert fast.choices == {}
    fast.tune(calls[:1], min_gain=-math.inf)
    again = _open(tmp_path, exact=True)
    assert again.choices == exact.choices and _open(tmp_path).choices == fast.choices
    for call in planned:
        x, w = _fresh(call, 7)
        y = again.run(call, x, w)  # replayed from the file, checked again
        assert y is not None and same_bits(y, call.run_torch(x, w)), call.label()


def _plan_without_torchs_bits(planner: CP.ConvPlanner) -> tuple[CP.ConvCall, CP.PlanChoice]:
    """A decoder call and a backend plan that runs it within the fast tier's tolerance but not
    with torch's bits (found by running every plan the frontend offers)."""
    cudnn = planner._cudnn
    for x, w, pad in _decoder_calls():
        call = CP.ConvCall.of(x, w, 1, pad)
        assert call is not None
        want = call.run_torch(x, w)
        g = CP._build_graph(cudnn, planner._handle, call, want.stride())
        g.graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        for i in range(int(g.graph.get_execution_plan_count())):
            try:
                engine_id, knobs = g.graph.get_engine_and_knobs_at_index(i)
                g.graph.build_plan_at_index(i)
                g.workspace = int(g.graph.get_workspace_size_plan_at_index(i))
                got = planner._execute(g, x, w, i)
            except Exception:  # noqa: BLE001 - plans that do not build or run
                continue
            if not same_bits(got, want) and CP._rel_err(got, want) <= CP.MAX_REL_ERR:
                knob_record = tuple(sorted((int(k), int(v)) for k, v in knobs.items()))
                return call, CP.PlanChoice(int(engine_id), knob_record, want.stride(), 1.0, 0.5, f"plan{i}")
    raise AssertionError("every plan of every decoder call gave torch's bits")


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@torch.inference_mode()
def test_cuda_the_exact_rule_refuses_a_plan_the_tolerance_takes(tmp_path: Any, caplog: Any) -> None:
    fast, exact = _open(tmp_path), _open(tmp_path, exact=True)
    call, choice = _plan_without_torchs_bits(fast)
    fast.choices[call] = exact.choices[call] = choice  # as if a file said so
    x, w = _fresh(call, 0)
    assert fast.run(call, x, w) is not None  # within the tolerance: replayed
    assert exact.run(call, x, w) is None  # not torch's bits: torch runs it
    assert "does not give torch's bits" in caplog.text


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@torch.inference_mode()
def test_cuda_a_planned_conv_is_captured_by_a_cuda_graph(tmp_path: Any) -> None:
    planner = _open(tmp_path)
    x, w, pad = _decoder_calls()[0]
    call = CP.ConvCall.of(x, w, 1, pad)
    assert call is not None
    planner.tune([call], min_gain=-math.inf)
    CP.install(planner)
    try:
        bias = torch.randn(w.shape[0], device="cuda", dtype=torch.bfloat16)
        eager = conv_with_plan(x, w, bias, 1, pad)
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = conv_with_plan(static_x, w, bias, 1, pad)
        captured.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        # and the graph reads its input: new values, the eager plan's new output
        static_x.copy_(torch.randn_like(x))
        graph.replay()
        assert torch.equal(captured, conv_with_plan(static_x, w, bias, 1, pad))
    finally:
        CP.uninstall(planner.device)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@torch.inference_mode()
def test_cuda_engine_runs_fast_convs_on_plans_and_lossless_on_exact_plans_stays_stock(
    tmp_path: Any, monkeypatch: Any
) -> None:
    from vaed.engine import DecodeEngine, OutputSpec
    from vaed.models import LoadedModel, build_random_vae

    vae = build_random_vae("wan2.1").to("cuda", torch.bfloat16).eval()
    z = torch.randn(1, 16, 3, 12, 20, device="cuda", dtype=torch.bfloat16)
    spec = {p: OutputSpec(rgb8=False, raw_dtype=None, raw_latents=True, precision=p) for p in Precision}
    loaded = LoadedModel(vae=vae, spec="random:wan2.1", random_weights=True)
    plain = DecodeEngine(loaded, kernels="auto", layout="channels_last")
    want = {p: plain.decode_video(z, spec[p]).cpu() for p in Precision}
    plain.close()

    # every conv gets a plan that meets its tier's rule, whatever its time (min_gain forced)
    real_tune = CP.ConvPlanner.tune
    monkeypatch.setattr(CP.ConvPlanner, "tune", lambda self, calls=None, progress=None, min_gain=0.0:
                        real_tune(self, calls, progress, min_gain=-math.inf))
    engine = DecodeEngine(loaded, kernels="auto", layout="channels_last", conv_plans=ConvPlans.TUNE,
                          conv_plan_file=str(tmp_path / CONV_PLAN_FILE))
    try:
        if not engine.conv_planners:
            pytest.skip("the cuDNN frontend is not installed")
        planner, exact = engine.conv_planners[Precision.FAST], engine.conv_planners[Precision.LOSSLESS]
        assert CP.planner_for(engine.device) is planner and not planner.exact
        assert CP.planner_for(engine.device, exact=True) is exact and exact.exact
        engine.prepare_conv_plans([(12, 20)])
        planned = [c for c, ch in planner.choices.items() if ch.engine_id is not None]
        assert len(planned) >= 8, planner.choices  # the decoder's conv shapes at this size
        assert any(ch.engine_id is not None for ch in exact.choices.values()), exact.choices
        runs: dict[bool, list[CP.ConvCall]] = {False: [], True: []}

        def counting(p: CP.ConvPlanner) -> Any:
            real_run = p.run

            def counted_run(call: CP.ConvCall, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
                runs[p.exact].append(call)
                return real_run(call, x, w)
            return counted_run

        monkeypatch.setattr(planner, "run", counting(planner))
        monkeypatch.setattr(exact, "run", counting(exact))
        fast = engine.decode_video(z, spec[Precision.FAST]).cpu()
        assert runs[False] and set(runs[False]) <= set(planner.choices) and runs[True] == []
        ran_plans = [c for c in runs[False] if planner.choices[c].engine_id is not None]
        assert ran_plans, "no conv of the fast decode ran on a plan"
        # the fast tier on plans: close to the fast tier on torch's convs (not its bits: other engines)
        mse = float(((fast.float() - want[Precision.FAST].float()) ** 2).mean())
        assert 10 * math.log10(4.0 / max(mse, 1e-20)) > 40.0  # PSNR over the [-1, 1] range
        runs[False].clear()
        lossless = engine.decode_video(z, spec[Precision.LOSSLESS]).cpu()
        assert runs[False] == []  # the lossless tier never asks the fast planner
        ran_exact = [c for c in runs[True] if exact.choices[c].engine_id is not None]
        assert ran_exact, "no conv of the lossless decode ran on an exact plan"
        assert torch.equal(lossless, want[Precision.LOSSLESS])
    finally:
        engine.close()
    assert CP.planner_for(engine.device) is None and CP.planner_for(engine.device, exact=True) is None
