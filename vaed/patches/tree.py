"""The Wan decoder's and encoder's forwards, written once, over an op set.

Each body mirrors one diffusers forward (verified against the versions in
:mod:`vaed.patches.versions`) line for line, except that the data movement
around each conv goes through an :class:`~vaed.patches.ops.OpSet`. Two
callers walk the same bodies:

* one device: the installed forwards (:mod:`vaed.patches.forwards`) enter
  here with the op set of the current call (:mod:`vaed.patches.context`);
* a spatial shard: :mod:`vaed.parallel.forward` enters :func:`decode` with
  the sharded op set, whose ops exchange halo rows at the four sites that
  read across the split (conv inputs and their pads, the upsamplers' image
  convs, the mid-block attention); the bodies do not know they are sharded.

A body visits its children through :meth:`Walk.visit`: a child of a class
ported here (exactly that class, in a configuration the port covers) runs its
body in the same walk; any other child is called as a module, the way stock
calls it, with a plain tensor. The walk never asks which forward a module has
bound, so a sharded decode works on a decoder whose forwards are stock.

Deferred conv biases (``OpSet.defer_bias``) travel as the carrier
:class:`Act`: a conv at a :class:`~vaed.patches.ops.BiasSite` may hand its
output on with its bias still to add, and every op reading an ``Act`` either
takes the bias into its own pass (a norm's ``x_bias``, the residual add, the
upsample gather, the DupUp3D add, a 1x1x1 shortcut conv) or adds it first
(:meth:`Act.settled`, aten's add, one rounding -- the conv's own bias pass,
so settling never changes a byte). Which sites leave their bias is the
walk's choice (``Walk.defer``: the op set's sites where its kernels run on
this device), made once per call; the bodies only name their sites and pass
the carrier along. An exact set defers only where its reader rounds as the
conv's own pass would (conv2 -> the residual add, the time_conv -> the
upsample gather, Wan2.2's upsampler -> the DupUp3D add), and never lets a
reader sum two biases: h's pending bias is settled before the residual add.
conv_in and conv_out keep their biases (their readers are one small latent
pass and the decoder's output).

The encoder runs the same bodies, not a second copy. ``WanEncoder3d`` is
built from the same modules: its causal convs, residual blocks and mid block
run the bodies above as they are; ``WanResample`` in ``downsample2d`` /
``downsample3d`` mode is one more branch of :func:`resample`
(:func:`downsample`: ZeroPad2d + the stride-2 image conv through
``OpSet.conv2d``, then the stride-2 time conv over [the previous chunk's last
frame | these frames], diffusers' cache rule: the first call caches its frames
and skips the time conv); Wan2.2's ``WanResidualDownBlock`` is
:func:`residual_up_block`'s mirror with the ``avgdown_add`` op beside
``dupup_add``; :func:`encode` enters like :func:`decode` with the encoder's
cache list (one call: frame 0, then four frames at a time, as
``AutoencoderKLWan._encode`` calls it). The encoder keeps every conv bias
where the decoder's bodies have no reader for it (its downsamplers settle
their input and leave no bias pending).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from torch import nn

from vaed.patches.derived import derived
from vaed.patches.layout import clone_keeps_strides, conv_reads_channels_last
from vaed.patches.ops import BiasSite, NormSilu, OpSet

# dtypes the op-set path takes; others (e.g. float8 activations, where diffusers'
# norm has its own rule) go through the stock forward
_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def op_path_ok(x: torch.Tensor) -> bool:
    """Whether a forward may take the op-set path: no autograd (stock keeps its exact graph),
    no torch.compile tracing, a dtype the ops take."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    return x.dtype in _DTYPES


def norm_silu_spec(norm: Any, act: Any, x: torch.Tensor) -> NormSilu | None:
    """A NormSilu for ``act(norm(x))`` when it is WanRMS_norm(channel_first, no bias) + SiLU."""
    g = getattr(norm, "gamma", None)
    if not isinstance(g, torch.Tensor):
        return None
    ok = (
        isinstance(act, nn.SiLU)
        and not act.inplace
        and getattr(norm, "channel_first", False)
        and isinstance(getattr(norm, "bias", None), float)
        and g.dim() == 4
        and g.numel() == x.shape[1]
    )
    return NormSilu(g, float(norm.scale), float(norm.bias)) if ok else None


# --- the carrier and the walk ------------------------------------------------------------


class Act(NamedTuple):
    """An activation and the per-channel bias its producing conv left out (None: none). A
    tuple, not a dataclass: about a hundred are made per decoder call, on the host's hot path."""

    x: torch.Tensor
    bias: torch.Tensor | None = None

    def settled(self) -> torch.Tensor:
        """``x`` with the bias added, as the conv would have (aten, one rounding)."""
        b = self.bias
        return self.x if b is None else self.x + b.view(1, -1, *([1] * (self.x.dim() - 2)))


class Walk:
    """One walk of the tree: the op set, diffusers' cache list and cursor, ``first_chunk``,
    whether marked convs leave their biases to their readers, and whether a child the tree
    does not port is an error (a shard cannot call a module that exchanges no halo)."""

    __slots__ = ("ops", "cache", "idx", "first_chunk", "defer", "strict")

    def __init__(
        self,
        ops: OpSet,
        cache: list | None,
        idx: list,
        first_chunk: Any,
        *,
        defer: frozenset[BiasSite],
        strict: bool = False,
    ) -> None:
        self.ops = ops
        self.cache = cache
        self.idx = idx
        self.first_chunk = first_chunk
        self.defer = defer
        self.strict = strict

    def visit(self, module: nn.Module, x: Act, *, up_block: bool = False, **site: Any) -> Act:
        """A child module on ``x``: its body when the tree ports it (``site``: keywords of that
        body, e.g. which reader an upsampler's output has), else the module as stock calls it
        (``up_block``: stock passes ``first_chunk`` too)."""
        port = ports().get(type(module))
        if port is not None and port.covers(module, self):
            return port.body(self, module, x, **site)
        if self.strict:
            raise TypeError(f"{type(module).__name__} is not a module the decoder tree ports here")
        plain = x.settled()
        if self.cache is None:
            return Act(module(plain))
        kw: dict[str, Any] = {"first_chunk": self.first_chunk} if up_block else {}
        return Act(module(plain, feat_cache=self.cache, feat_idx=self.idx, **kw))

    def conv(
        self, conv: Any, x: Act, norm: tuple[Any, Any] | None = None, *, site: BiasSite | None = None
    ) -> Act:
        """conv([cache | x]), or of SiLU(norm(x)) when ``norm`` = (norm, activation): one cached
        call site (the cache slot at the cursor is read and replaced). The norm goes into the
        op when it is the standard one, and ``x``'s pending bias with it; at a ``site`` the
        walk defers, the conv hands its own bias on."""
        pending = conv.bias if site in self.defer else None
        spec = None
        if norm is None:
            inp = x.settled()
        else:
            spec = norm_silu_spec(norm[0], norm[1], x.x)
            if spec is None:
                inp = norm[1](norm[0](x.settled()))
            else:
                inp = x.x
                spec = dataclasses.replace(spec, x_bias=x.bias) if x.bias is not None else spec
        assert self.cache is not None
        i = self.idx[0]
        out, nxt = self.ops.causal_conv(conv, inp, self.cache[i], tuple(conv._padding), norm=spec, bias=pending is None)
        self.cache[i] = nxt
        self.idx[0] += 1
        return Act(out, pending)


def _opmath(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the precision aten computes its elementwise ops in (fp32 for half dtypes)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


# --- the bodies (diffusers' forwards, one each) --------------------------------------------


def causal_conv(ops: OpSet, conv: Any, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """WanCausalConv3d.forward: [cache | x] + zero padding, then the conv."""
    pad = tuple(conv._padding)
    if cache_x is not None and pad[4] > 0:
        cache_x = cache_x.to(x.device)
    padded, _ = ops.causal_pad(x, cache_x, pad, emit_cache=False, channels_last=conv_reads_channels_last(conv, x))
    return ops.conv3d(conv, padded)


def _pointwise(sc: Any) -> bool:
    """A 1x1x1 conv without padding: sc(x + b) = sc_nobias(x) + (bias + W @ b) exactly in real
    arithmetic (no padding mixes in zeros), so it can take and pass on a pending bias."""
    return (
        sc.bias is not None
        and sc.weight.shape[2:] == (1, 1, 1)
        and not any(sc._padding)
        and sc.groups == 1
    )


def shortcut(w: Walk, sc: Any, x: Act) -> Act:
    """The residual block's shortcut of ``x``: identity passes ``x``'s pending bias on; a 1x1x1
    conv runs without its bias when deferring and passes on bias + W @ (x's pending bias)."""
    if isinstance(sc, nn.Identity):
        return x
    if type(sc) not in ports():  # not the causal conv the tree ports: the module, as stock calls it
        if w.strict:
            raise TypeError(f"{type(sc).__name__} is not a shortcut the decoder tree ports")
        return Act(sc(x.settled()))
    if not (BiasSite.SHORTCUT_RESIDUAL in w.defer and _pointwise(sc)):
        return Act(causal_conv(w.ops, sc, x.settled()))
    h = w.ops.conv3d(sc, x.x, bias=False)  # no padding: the conv input is x itself
    if x.bias is None:
        return Act(h, sc.bias)
    wt, b, xb = sc.weight, sc.bias, x.bias
    return Act(h, derived(sc, "shortcut_bias", (wt, b, xb), lambda: _opmath(b) + _opmath(wt.flatten(1)) @ _opmath(xb)))


def residual_add(w: Walk, owner: nn.Module, x: Act, h: Act) -> Act:
    """x + h, every pending bias of both added in the same pass (summed once, fp32, per module);
    an exact set adds h's to h first (its conv's own pass), leaving x's bias alone to the op."""
    if w.ops.exact and h.bias is not None:
        h = Act(h.settled())
    b, hb = x.bias, h.bias
    bias = b if hb is None else hb if b is None else (
        derived(owner, "residual_bias", (b, hb), lambda: _opmath(b) + _opmath(hb))
    )
    return Act(w.ops.residual_add(x.x, h.x) if bias is None else w.ops.residual_add(x.x, h.x, bias))


def residual_block(w: Walk, rb: Any, x: Act) -> Act:
    """WanResidualBlock.forward: shortcut, norm1+SiLU -> conv1, norm2+SiLU -> conv2, + shortcut."""
    h = shortcut(w, rb.conv_shortcut, x)
    act = rb.nonlinearity
    x = w.conv(rb.conv1, x, (rb.norm1, act), site=BiasSite.CONV1_NORM)
    x = w.conv(rb.conv2, x, (rb.norm2, act), site=BiasSite.CONV2_RESIDUAL)  # dropout: identity (see PORTS)
    return residual_add(w, rb, x, h)


def mid_block(w: Walk, mid: Any, x: Act) -> Act:
    """WanMidBlock.forward: a residual block, then (attention, residual block) pairs."""
    x = w.visit(mid.resnets[0], x)
    for attn, resnet in zip(mid.attentions, mid.resnets[1:], strict=False):  # as stock zips them
        if attn is not None:
            x = Act(w.ops.attention(attn, x.settled()))
        x = w.visit(resnet, x)
    return x


def resample(w: Walk, rs: Any, x_in: Act, *, image_conv_site: BiasSite = BiasSite.IMAGE_CONV_BLOCK) -> Act:
    """WanResample.forward for upsample2d/upsample3d: the time_conv with diffusers' "Rep" cache
    marker (first call: no time upsampling), the frame interleave, nearest 2x, the image conv
    (``image_conv_site``: who reads its output, so whether it may leave its bias). The
    downsample modes are :func:`downsample`."""
    if rs.mode in DOWNSAMPLE_MODES:
        return downsample(w, rs, x_in)
    x = x_in.settled()
    b, t = x.size(0), x.size(2)
    interleave = False
    time_bias = None  # the time_conv's, left to the upsample gather
    if rs.mode == "upsample3d" and w.cache is not None:
        idx = w.idx[0]
        prev = w.cache[idx]
        if prev is None:
            w.cache[idx] = "Rep"
        else:
            rep = isinstance(prev, str)
            padded, nxt = w.ops.causal_conv_input(
                x, None if rep else prev.to(x.device), tuple(rs.time_conv._padding), zero_history=rep,
                channels_last=conv_reads_channels_last(rs.time_conv, x),
            )
            if BiasSite.TIME_CONV_UPSAMPLE in w.defer:
                time_bias = rs.time_conv.bias
            x = w.ops.conv3d(rs.time_conv, padded, bias=time_bias is None)
            w.cache[idx] = nxt
            interleave = True
        w.idx[0] += 1
    images = w.ops.upsample2x(x, interleave, time_bias)
    conv = rs.resample[1]
    pending = conv.bias if image_conv_site in w.defer else None
    y = w.ops.conv2d(conv, images) if pending is None else w.ops.conv2d(conv, images, bias=False)
    t_out = t * 2 if interleave else t
    return Act(y.view(b, t_out, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4), pending)


def downsample(w: Walk, rs: Any, x_in: Act) -> Act:
    """WanResample.forward for downsample2d/downsample3d: per frame ZeroPad2d((0, 1, 0, 1)) and
    the stride-2 image conv; in 3d mode with a cache, the stride-2 time_conv over [last frame
    of the previous call | these frames]. diffusers' first call stores its frames and runs no
    time conv (one frame in, one out); every later call halves its frames (Wan's two time
    downsamples: 4 -> 2 -> 1), so each encoder call gives one latent frame."""
    x = x_in.settled()
    b, c, t, h, wd = x.size()
    images = rs.resample[0](x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, wd))  # ZeroPad2d, as stock calls it
    y = w.ops.conv2d(rs.resample[1], images)
    x = y.view(b, t, y.size(1), y.size(2), y.size(3)).permute(0, 2, 1, 3, 4)
    if rs.mode == "downsample3d" and w.cache is not None:
        idx = w.idx[0]
        prev = w.cache[idx]
        if prev is None:
            w.cache[idx] = x.clone()
        else:
            nxt = x[:, :, -1:].clone()
            # stock: time_conv(cat([prev[:, :, -1:], x])), whose own padding is zero; the
            # causal pad op builds the same [cache | x] input (one pass where a kernel runs)
            padded, _ = w.ops.causal_pad(x, prev[:, :, -1:], (0, 0, 0, 0, 1, 0), emit_cache=False,
                                         channels_last=conv_reads_channels_last(rs.time_conv, x))
            x = w.ops.conv3d(rs.time_conv, padded)
            w.cache[idx] = nxt
        w.idx[0] += 1
    return Act(x)


def up_block(w: Walk, up: Any, x: Act) -> Act:
    """WanUpBlock.forward (Wan2.1): resnets, then the upsampler (its pending bias goes on)."""
    for resnet in up.resnets:
        x = w.visit(resnet, x)
    x = Act(x.settled())  # no resnets (not in Wan2.1): nothing took it
    if up.upsamplers is None:
        return x
    return w.visit(up.upsamplers[0], x)


def _shortcut_source(x: torch.Tensor) -> torch.Tensor:
    """Stock's ``x.clone()`` for a residual up/down block's shortcut. The blocks below never
    write into x, so where that clone would keep x's strides (x dense in any dim order: the
    channels-last or contiguous layouts, and Wan2.2's NTCHW block input after an upsampler,
    whose clone of [1, 1024, 4, 176, 320] at 704x1280 wrote 461 MB a call) x itself holds the
    same bytes in the same layout."""
    return x if clone_keeps_strides(tuple(x.shape), x.stride()) else x.clone()


def residual_up_block(w: Walk, up: Any, x_in: Act) -> Act:
    """WanResidualUpBlock.forward (Wan2.2): resnets, upsampler, + DupUp3D(x) shortcut, which
    takes the upsampler's pending bias."""
    x = x_in.settled()
    x_copy = _shortcut_source(x)
    h = Act(x)
    for resnet in up.resnets:
        h = w.visit(resnet, h)
    sc = up.avg_shortcut
    if up.upsampler is not None:
        site = BiasSite.IMAGE_CONV_DUPUP if sc is not None else BiasSite.IMAGE_CONV_BLOCK
        h = w.visit(up.upsampler, h, image_conv_site=site)
        if sc is None:  # nothing below takes the bias (diffusers builds both or neither)
            h = Act(h.settled())
    if sc is None:
        return h
    first = bool(w.first_chunk)
    if h.bias is None:
        return Act(w.ops.dupup_add(h.x, x_copy, sc.factor_t, sc.factor_s, first))
    return Act(w.ops.dupup_add(h.x, x_copy, sc.factor_t, sc.factor_s, first, bias=h.bias))


def residual_down_block(w: Walk, down: Any, x_in: Act) -> Act:
    """WanResidualDownBlock.forward (Wan2.2): resnets, downsampler, + AvgDown3D(x) shortcut."""
    x = x_in.settled()
    x_copy = _shortcut_source(x)
    h = Act(x)
    for resnet in down.resnets:
        h = w.visit(resnet, h)
    if down.downsampler is not None:
        h = w.visit(down.downsampler, h)
    sc = down.avg_shortcut
    return Act(w.ops.avgdown_add(h.settled(), x_copy, sc.factor_t, sc.factor_s, sc.out_channels))


def encoder(w: Walk, enc: Any, x: torch.Tensor) -> torch.Tensor:
    """WanEncoder3d.forward with a cache: conv_in, down blocks, mid block, norm_out+SiLU -> conv_out."""
    h = w.conv(enc.conv_in, Act(x))
    for layer in enc.down_blocks:
        h = w.visit(layer, h)
    h = w.visit(enc.mid_block, h)
    return w.conv(enc.conv_out, h, (enc.norm_out, enc.nonlinearity)).x


def decoder(w: Walk, dec: Any, x: torch.Tensor) -> torch.Tensor:
    """WanDecoder3d.forward with a cache: conv_in, mid block, up blocks, norm_out+SiLU -> conv_out."""
    h = w.conv(dec.conv_in, Act(x))
    h = w.visit(dec.mid_block, h)
    for up in dec.up_blocks:
        h = w.visit(up, h, up_block=True)
    return w.conv(dec.conv_out, h, (dec.norm_out, dec.nonlinearity)).x


def decode(
    ops: OpSet, dec: nn.Module, x: torch.Tensor, cache: list, first_chunk: bool, *, strict: bool = False
) -> torch.Tensor:
    """One decoder call on one latent frame (post_quant_conv'd), cache list in diffusers' layout."""
    w = Walk(ops, cache, [0], first_chunk, defer=ops.deferred_bias_sites(x), strict=strict)
    return decoder(w, dec, x)


def encode(ops: OpSet, enc: nn.Module, x: torch.Tensor, cache: list, *, strict: bool = False) -> torch.Tensor:
    """One encoder call (frame 0, or the next four frames; patchified for Wan2.2), cache list in
    diffusers' layout; returns one latent frame of the encoder's output (before quant_conv)."""
    w = Walk(ops, cache, [0], None, defer=ops.deferred_bias_sites(x), strict=strict)
    return encoder(w, enc, x)


# --- which modules the tree ports --------------------------------------------------------


UPSAMPLE_MODES = ("upsample2d", "upsample3d")
DOWNSAMPLE_MODES = ("downsample2d", "downsample3d")


def resample_ok(m: nn.Module) -> bool:
    """WanResample upsampling whose WanUpsample is the nearest-exact 2x the ops reproduce, or
    downsampling whose image conv is a Conv2d (its ZeroPad2d is called as stock calls it)."""
    mode = getattr(m, "mode", None)
    if mode in DOWNSAMPLE_MODES:
        return isinstance(m.resample, nn.Sequential) and len(m.resample) == 2 and isinstance(m.resample[1], nn.Conv2d)
    if mode not in UPSAMPLE_MODES:
        return False
    resample: Any = m.resample  # (Upsample, Conv2d); diffusers' modules carry no type hints
    up = resample[0]
    sf = getattr(up, "scale_factor", None)
    return (
        isinstance(up, nn.Upsample)
        and getattr(up, "mode", None) == "nearest-exact"
        and tuple(sf if isinstance(sf, tuple) else (sf, sf)) == (2.0, 2.0)
        and up.size is None
        and not getattr(up, "recompute_scale_factor", None)
        and isinstance(resample[1], nn.Conv2d)
    )


def dropout_off(rb: Any) -> bool:
    """The residual block's dropout is the identity (eval mode, or p = 0)."""
    return not (rb.dropout.training and rb.dropout.p != 0.0)


@dataclass(frozen=True)
class Port:
    """A diffusers class the tree ports: its body, and when the body covers an instance."""

    body: Callable[..., Act]  # (walk, module, x, **site keywords) -> Act
    covers: Callable[[Any, Walk], bool] = lambda m, w: True


# diffusers class name -> port; the cached blocks need a cache (stock runs without one)
PORTS_BY_NAME: dict[str, Port] = {
    "WanCausalConv3d": Port(lambda w, conv, x: Act(causal_conv(w.ops, conv, x.settled()))),
    "WanResidualBlock": Port(residual_block, lambda m, w: w.cache is not None and dropout_off(m)),
    "WanMidBlock": Port(mid_block, lambda m, w: w.cache is not None),
    "WanResample": Port(resample, lambda m, w: resample_ok(m)),
    "WanUpBlock": Port(up_block),
    "WanResidualUpBlock": Port(residual_up_block),
    "WanResidualDownBlock": Port(residual_down_block),
}


@functools.cache
def ports() -> dict[type, Port]:
    """PORTS_BY_NAME keyed by the diffusers classes (exact classes: a subclass may override
    the very forward a body mirrors)."""
    from diffusers.models.autoencoders import autoencoder_kl_wan as W

    return {getattr(W, name): port for name, port in PORTS_BY_NAME.items() if hasattr(W, name)}
