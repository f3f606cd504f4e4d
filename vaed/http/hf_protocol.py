"""Hugging Face's remote-VAE protocol, as diffusers' `remote_decode` and `remote_encode` speak it: the request's
query, its raw tensor body, and the answers (pure functions; `vaed.http.front` serves them).

What diffusers' client sends (`diffusers.utils.remote_utils.prepare_decode`): a POST whose body is
the tensor's bytes in C order, with query parameters `shape` (one per dimension), `dtype`,
`output_type` (pt | pil | mp4), `partial_postprocess`, `image_format`, and `do_scaling` or
`scaling_factor` / `shift_factor`; Python booleans arrive as "True" / "False". What it reads back
(`postprocess_decode`): for `pt`, and for `pil` with a processor, raw bytes with a `shape` (JSON)
and a `dtype` header; for `mp4` the file's bytes; on an error it raises
`RuntimeError(response.json())`, so errors are JSON objects `{"error": ...}`.

The answers, per request (batch B, T output frames of H x W):

=====================================  ===============================================
`pt`                                   the decoder's output `[B, 3, T, H, W]` in the
                                       compute dtype, clamped to [-1, 1] (what
                                       `vae.decode(...).sample` is, and what diffusers'
                                       `VideoProcessor.postprocess_video` takes); sent
                                       once the call is done
`pt` + `partial_postprocess=True`      uint8 frames `[T, H, W, 3]` (B = 1): the client
                                       turns each of dim 0 into a PIL image; streamed
`pil` + a processor (Accept            `VideoProcessor.postprocess_video(video, "pt")[0]`:
tensor/binary)                         `[T, 3, H, W]` in [0, 1], in the compute dtype; the
                                       client scales by 255 and rounds, as the local
                                       pipeline does, so its PIL frames are the pipeline's;
                                       streamed
`pil` without a processor (Accept      one frame (a one-latent-frame video) as a JPEG or
image/jpeg or image/png)               PNG image; a longer video is refused
`mp4`                                  an H.264 MP4 file (`vaed.video`), fps 16 for Wan2.1
                                       and 24 for Wan2.2 unless `fps` is given
=====================================  ===============================================

Scaling, for Wan (`do_scaling`, `scaling_factor`, `shift_factor`): Wan's latents are normalised
per channel (`latents_mean`, `latents_std` in the VAE's config), not by one scalar. WanPipeline's
decode step computes `latents / (1 / latents_std) + latents_mean` and hands that to `vae.decode`.
So:

* `do_scaling=True` (what `remote_decode` sends by default) means "the server applies the model's
  scaling": the server runs that decode step, so the tensor is the pipeline's
  `output_type="latent"` output (vaed's gRPC default, `raw_latents=False`);
* no `do_scaling` (`remote_decode(..., do_scaling=False)` sends none) means the tensor is already
  what `vae.decode` receives (gRPC's `raw_latents=True`);
* `scaling_factor` and `shift_factor` are refused (400): one number cannot express a per-channel
  normalisation, and silently ignoring them would decode wrong colours.

Encode (POST /encode), as diffusers' `remote_encode(endpoint, image)` speaks it
(`remote_utils.prepare_encode` / `postprocess_encode`): a PIL image arrives as a PNG file body with
no parameters; a tensor as its C-order bytes with `shape` and `dtype`. The answer is raw bytes with
`shape` and `dtype` headers, as for `pt`. What vaed takes and gives:

=====================================  ========================================
body                                   a PNG / JPEG image (RGB, 0..255 mapped to [-1, 1]
                                       as diffusers' image processor does), or a tensor:
                                       float `[B, 3, H, W]` / `[B, 3, T, H, W]` in [-1, 1],
                                       uint8 `[B, H, W, 3]` / `[B, T, H, W, 3]`; an image
                                       is a 1-frame video, T = 1 + 4k
answer (no factors, the default)       the posterior's mode, `vae.encode(x).latent_dist
                                       .mode()`: VAE-space latents, what
                                       `remote_decode(..., do_scaling=False)` takes back
answer with `do_scaling=true` (vaed's) `(mode - latents_mean) / latents_std` as the Wan
                                       pipelines normalise, what `remote_decode`'s default
                                       (do_scaling=True) takes back
shape                                  `[B, z_dim, h, w]` for an image (remote_encode's
                                       rank), `[B, z_dim, T_lat, h, w]` for a video; in
                                       the encode's compute dtype
=====================================  ===============================================

The mode, not a sample: the Wan pipelines condition on `retrieve_latents(..., sample_mode="argmax")`,
and a sample would differ on every call. `scaling_factor` / `shift_factor` (Flux's and SD's one
number each, `(latent - shift) * scaling`) are refused as for decode. The frames go through the
same call core as gRPC Encode (`vaed.calls.CallCore.encode`): the answer is the gRPC encode's bits.

Streamed answers: where time is the answer's outermost dimension (`[T, H, W, 3]`, `[T, 3, H, W]`),
each group's bytes follow the previous group's in the C-order answer, so they are sent as each
group decodes, under a `Content-Length` computed from the latents' shape (T latent frames decode
to 1 + 4 (T - 1) frames) with the `shape` and `dtype` headers before the first byte. The raw `pt`
answer cannot be: `[B, 3, T, H, W]` is channel-major, so its first channel's last frame precedes
its second channel's first in the bytes. A failure after the headers went out cuts the body short
(the client's read fails on the missing bytes) instead of answering a status.

`height` / `width` are for packed (Flux) latents; Wan's are 5-D, so they are accepted only when they
equal the decoded size.

vaed's own extensions (ignored by diffusers, which never sends them): `fps`, `crf`, `lossless` for
mp4 (`vaed.video.VideoOptions`), `stream=true` (mp4 only: the fMP4 bytes are sent with chunked
transfer as the frames decode), `precision` (lossless | fast), `allow_non_finite=true` (NaN / Inf
latents or frames taken as they are, as gRPC's option), and an `X-Request-Id` header (once). A
parameter that is neither diffusers' nor vaed's, or one given twice (`shape` aside), is refused (400): a
misspelt `do_scaling` ignored would decode wrong colours, and of two values either could be meant.
"""

from __future__ import annotations

import enum
import io
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from multidict import MultiMapping

from vaed_client import wire

from ..choices import Precision
from ..errors import InvalidInput
from ..session import check_finite
from ..video import DEFAULT_CRF, VideoError, VideoOptions

# The dtype names diffusers' client uses (`str(tensor.dtype).split(".")[-1]`, its DTYPE_MAP).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "uint8": torch.uint8,
}
LATENT_DTYPE_NAMES = ("float16", "bfloat16", "float32")
_NAME_OF = {dtype: name for name, dtype in DTYPE_NAMES.items()}

LATENT_DIMS = 5  # [B, z, T, h, w]


class OutputType(enum.StrEnum):
    PT = "pt"
    PIL = "pil"
    MP4 = "mp4"


class Answer(enum.Enum):
    """What a request's answer holds (see the module docstring's table)."""

    RAW = "raw"            # pt: the decoder's output
    FRAMES = "frames"      # pt + partial_postprocess: uint8 [T, H, W, 3]
    UNIT = "unit"          # pil + a processor: [T, 3, H, W] in [0, 1]
    IMAGE = "image"        # pil without a processor: one JPEG / PNG frame
    MP4 = "mp4"


_IMAGE_FORMATS = {"jpg": ("JPEG", "image/jpeg"), "jpeg": ("JPEG", "image/jpeg"), "png": ("PNG", "image/png")}
# JPEG holds each side in 16 bits, and libjpeg (PIL's writer) takes at most 65500 px of it.
JPEG_MAX_SIDE = 65500
_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")

# Each route's query parameters: first what diffusers 0.42's client sends (`prepare_decode`: shape,
# dtype, output_type, partial_postprocess, image_format, do_scaling or scaling_factor / shift_factor,
# height / width; `prepare_encode`: shape, dtype, scaling_factor / shift_factor), then vaed's own. Any
# other name is refused: a misspelt one ignored (do_scalling=true) would decode raw latents, in wrong colours.
DECODE_PARAMETERS = ("shape", "dtype", "output_type", "partial_postprocess", "image_format", "do_scaling",
                     "scaling_factor", "shift_factor", "height", "width",
                     "fps", "crf", "lossless", "stream", "precision", "allow_non_finite")
ENCODE_PARAMETERS = ("shape", "dtype", "scaling_factor", "shift_factor", "do_scaling", "precision", "allow_non_finite")


@dataclass(frozen=True)
class DecodeQuery:
    """One request's parameters, checked; nothing of the body is read to make it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    answer: Answer
    raw_latents: bool                  # True: the tensor is vae.decode's input (no do_scaling)
    image_format: str = "JPEG"         # Answer.IMAGE: PIL's format name
    video: VideoOptions | None = None  # Answer.MP4
    stream: bool = False               # Answer.MP4: fMP4 sent as it is encoded
    precision: Precision | None = None  # None: the server's default
    height: int | None = None
    width: int | None = None
    allow_non_finite: bool = False     # NaN / Inf latents decoded as they are (gRPC's option)

    @property
    def rgb8(self) -> bool:
        """Whether the answer is made from the server's RGB8 frames (else from the RAW output)."""
        return self.answer in (Answer.FRAMES, Answer.IMAGE, Answer.MP4)


def _flag(query: Mapping[str, str], name: str, default: bool) -> bool:
    value = query.get(name)
    if value is None:
        return default
    if value.lower() in _TRUE:
        return True
    if value.lower() in _FALSE:
        return False
    raise InvalidInput(f"{name} must be true or false, got {value!r}")


# ASCII digits only: int() also takes "1_000", " 7 " and other scripts' digits ("٧"), which no
# client means as a size; 18 digits keep every value within int64.
_INTEGER = re.compile(r"-?[0-9]{1,18}")


def _integer(text: str) -> int:
    """A query's integer; ValueError unless `text` is an optional '-' and 1-18 ASCII digits."""
    if not _INTEGER.fullmatch(text):
        raise ValueError(text)
    return int(text)


def _int(query: Mapping[str, str], name: str) -> int | None:
    value = query.get(name)
    if value is None:
        return None
    try:
        return _integer(value)
    except ValueError:
        raise InvalidInput(f"{name} must be an integer, got {value!r}") from None


def _shape_sizes(values: Sequence[str]) -> tuple[int, ...]:
    """The `shape` parameters' sizes, one per dimension (decode's and encode's)."""
    try:
        return tuple(_integer(v) for v in values)
    except ValueError:
        raise InvalidInput(f"shape must be integers, got {list(values)}") from None


def parse_shape(values: Sequence[str]) -> tuple[int, ...]:
    if not values:
        raise InvalidInput("shape is required: one shape= parameter per dimension of [B, z, T, h, w]")
    shape = _shape_sizes(values)
    if len(shape) != LATENT_DIMS or any(d < 1 for d in shape):
        raise InvalidInput(f"shape must be 5 positive sizes [B, z, T, h, w] (Wan latents), got {list(shape)}")
    return shape


def _single_values(params: MultiMapping[str], accepted: Sequence[str]) -> dict[str, str]:
    """Each parameter's one value (`shape` aside: one per dimension); InvalidInput for a name the
    route does not take, or one given twice (which of its values was meant is the client's guess)."""
    names = [name for name, _ in params.items()]  # a name given twice is listed twice (keys() lists it once)
    for name in names:
        if name not in accepted:
            raise InvalidInput(f"unknown query parameter {name!r}; this route takes {', '.join(accepted)}")
    for name in dict.fromkeys(names):
        if name != "shape" and (count := names.count(name)) > 1:
            raise InvalidInput(f"query parameter {name!r} is given {count} times; give it once")
    return {name: params[name] for name in names if name != "shape"}


def _accepts_an_image(accept: str) -> bool:
    """Whether an Accept header names an image type (remote_decode sends `image/jpeg` or
    `image/png` for output_type pil without a processor); media types are case-insensitive and
    the header may list several."""
    return any(part.strip().lower().startswith("image/") for part in accept.split(","))


def parse_query(params: MultiMapping[str], accept: str, default_fps: int) -> DecodeQuery:
    """The request's parameters (each once, `shape` once per dimension), checked; InvalidInput says
    what is wrong."""
    query = _single_values(params, DECODE_PARAMETERS)
    shape = parse_shape(params.getall("shape", []))
    dtype_name = query.get("dtype")
    if dtype_name is None:
        raise InvalidInput(f"dtype is required: one of {', '.join(LATENT_DTYPE_NAMES)}")
    if dtype_name not in LATENT_DTYPE_NAMES:
        raise InvalidInput(f"dtype {dtype_name!r} is not a latent dtype; use one of {', '.join(LATENT_DTYPE_NAMES)}")
    try:
        output_type = OutputType(query.get("output_type", "pt"))
    except ValueError:
        raise InvalidInput(
            f"output_type {query.get('output_type')!r} is not served; use one of "
            f"{', '.join(t.value for t in OutputType)}") from None
    for name in ("scaling_factor", "shift_factor"):
        if name in query:
            raise InvalidInput(
                f"{name} is not used by Wan: its latents are normalised per channel (latents_mean / latents_std). "
                "Send do_scaling=True (remote_decode's default) for the server to apply WanPipeline's decode step, "
                "or do_scaling=False with latents already as vae.decode takes them")
    raw_latents = not _flag(query, "do_scaling", False)
    partial = _flag(query, "partial_postprocess", False)
    stream = _flag(query, "stream", False)
    image_format = query.get("image_format", "jpg").lower()
    if image_format not in _IMAGE_FORMATS:
        raise InvalidInput(f"image_format {image_format!r} is not served; use jpg or png")
    if output_type is OutputType.PT:
        answer = Answer.FRAMES if partial else Answer.RAW
    elif output_type is OutputType.PIL:
        answer = Answer.IMAGE if _accepts_an_image(accept) else Answer.UNIT
    else:
        answer = Answer.MP4
    if shape[0] != 1 and answer is not Answer.RAW:
        raise InvalidInput(
            f"output_type {output_type.value}{' with partial_postprocess' if partial else ''} answers one video: "
            f"send batch 1 (shape[0]), got {shape[0]}; output_type pt without partial_postprocess takes a batch")
    if answer is Answer.IMAGE and shape[2] != 1:
        raise InvalidInput(
            f"output_type pil without a processor answers one image, and {shape[2]} latent frames decode to a "
            "video; pass processor=VideoProcessor(), or use output_type mp4 or pt")
    if stream and answer is not Answer.MP4:
        raise InvalidInput("stream=true is served for output_type mp4 only")
    video = None
    if answer is Answer.MP4:
        if _flag(query, "lossless", False) and "crf" in query:
            raise InvalidInput("crf is an option of lossy mp4; lossless=true is always CRF 0")
        try:
            video = VideoOptions(  # fps=0 is refused as any fps out of range; only an absent one is the default
                fps=default_fps if (fps := _int(query, "fps")) is None else fps,
                crf=DEFAULT_CRF if (crf := _int(query, "crf")) is None else crf,
                lossless=_flag(query, "lossless", False),
            )
        except VideoError as exc:
            raise InvalidInput(str(exc)) from None
    elif any(name in query for name in ("fps", "crf", "lossless")):
        raise InvalidInput("fps, crf and lossless are options of output_type mp4")
    try:
        precision = Precision.parse(query["precision"], "precision") if "precision" in query else None
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    height, width = _int(query, "height"), _int(query, "width")
    if (height is None) != (width is None):
        raise InvalidInput("height and width go together")
    return DecodeQuery(
        shape=shape, dtype=DTYPE_NAMES[dtype_name], answer=answer, raw_latents=raw_latents,
        image_format=_IMAGE_FORMATS[image_format][0], video=video, stream=stream, precision=precision,
        height=height, width=width, allow_non_finite=_flag(query, "allow_non_finite", False),
    )


def check_decoded_size(query: DecodeQuery, scale_spatial: int) -> None:
    """What the latents' shape says of the frames, checked before the call runs: height / width, when
    given, must be their size (they exist for packed latents), and a JPEG answer's sides JPEG's."""
    h, w = query.shape[3] * scale_spatial, query.shape[4] * scale_spatial
    if query.height is not None and (query.height, query.width) != (h, w):
        raise InvalidInput(
            f"height x width {query.height}x{query.width} is not the decoded size {h}x{w} of latents "
            f"{list(query.shape)}; Wan latents are not packed: leave height and width out")
    if query.answer is Answer.IMAGE and query.image_format == "JPEG" and max(h, w) > JPEG_MAX_SIDE:
        raise InvalidInput(
            f"latents {list(query.shape)} decode to an image of {h}x{w} px, and a JPEG image is at most "
            f"{JPEG_MAX_SIDE} px a side; ask image_format=png, or output_type pt")


def check_finite_latents(latents: torch.Tensor) -> None:
    """The core's NaN / Inf check (`vaed.session.check_finite`, its message) on every latent frame
    of a request, before the answer's status goes out: the core checks each frame only as it decodes
    it, after a streamed answer's status and first frames were sent. One frame at a time, so its
    temporaries are one frame's size."""
    for index in range(latents.shape[2]):
        check_finite(latents[:, :, index], index)


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def check_body_bytes(length: int, what: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """A tensor body's Content-Length against the shape and dtype its query declares (`what`:
    latents or frames), before the body is read."""
    if length != (expected := tensor_nbytes(shape, dtype)):
        raise InvalidInput(f"the body is {length} bytes, and {what} of shape {list(shape)} in "
                           f"{_NAME_OF[dtype]} are {expected}")


class RawLatents:
    """A request body as the call core's latents (its `LatentsIn`): shape and dtype from the query,
    the byte count checked before the body was read; the tensor is a view of the body (no copy)."""

    def __init__(self, body: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._body = body
        self._shape = shape
        self._dtype = dtype

    def header(self) -> tuple[tuple[int, ...], torch.dtype]:
        expected = tensor_nbytes(self._shape, self._dtype)
        if self._body.nbytes != expected:  # the front reads exactly Content-Length; this is the last guard
            raise InvalidInput(f"latents: {self._body.nbytes} bytes for shape {list(self._shape)} need {expected}")
        return self._shape, self._dtype

    def to_tensor(self) -> torch.Tensor:
        return torch.frombuffer(self._body, dtype=self._dtype).reshape(self._shape)


@dataclass(frozen=True)
class DeclaredTensor:
    """A request's tensor as its query declares it, before its body is read: the call core's view of
    a first message for the checks it makes from the head (`header`). None for an image file, whose
    size only its own header says (the core's open reads no frames' header)."""

    shape: tuple[int, ...] | None
    dtype: torch.dtype | None

    def header(self) -> tuple[tuple[int, ...], torch.dtype]:
        assert self.shape is not None and self.dtype is not None  # an image file's is read with its body
        return self.shape, self.dtype

    def to_tensor(self) -> torch.Tensor:
        raise AssertionError("a declared tensor has no values: its body is not read yet")


# -- encode: what `remote_encode` sends -----------------------------------------------------

IMAGE_DIMS, VIDEO_DIMS = 4, 5


@dataclass(frozen=True)
class EncodeQuery:
    """One encode request's parameters, checked before the body is read (see `parse_encode_query`)."""

    shape: tuple[int, ...] | None   # None: the body is an image file (PNG, as remote_encode sends PIL)
    dtype: torch.dtype | None
    normalised: bool                # do_scaling=true: (mean - latents_mean) / latents_std
    precision: Precision | None = None
    allow_non_finite: bool = False  # NaN / Inf frames and moments as they are (gRPC's option)

    @property
    def image(self) -> bool:
        """An image in (a PIL image, or a 4-D tensor): the answer drops the time axis, as
        remote_encode's `[B, C, h, w]` of an image."""
        return self.shape is None or len(self.shape) == IMAGE_DIMS

    @property
    def video_shape(self) -> tuple[int, ...]:
        """The tensor's shape as the encoder's 5-D frames: an image is a 1-frame video (float
        `[B, 3, H, W]` -> `[B, 3, 1, H, W]`, uint8 `[B, H, W, 3]` -> `[B, 1, H, W, 3]`)."""
        assert self.shape is not None
        if len(self.shape) == VIDEO_DIMS:
            return self.shape
        return (*self.shape[:self._time_dim], 1, *self.shape[self._time_dim:])

    @property
    def frame_count(self) -> int:
        """T of the video (1 for an image)."""
        return self.video_shape[self._time_dim]

    @property
    def _time_dim(self) -> int:
        return 1 if self.dtype == torch.uint8 else 2

    def as_sent(self, exc: InvalidInput) -> InvalidInput:
        """A message of the limits' checks, which name an image's frames by their video view
        (`[B, H, W, 3]` as `[B, 1, H, W, 3]`), naming the shape the client sent instead."""
        assert self.shape is not None
        return InvalidInput(str(exc).replace(str(list(self.video_shape)), str(list(self.shape))))


def check_encoder_frames(query: EncodeQuery, scale_temporal: int) -> None:
    """The frame count the causal encoder takes, 1 + scale_temporal k (`wire.encoded_latent_frames`,
    the core's rule on a call's frames once they are all in), from the query's shape."""
    try:
        wire.encoded_latent_frames(query.frame_count, scale_temporal)
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None


def parse_encode_query(params: MultiMapping[str]) -> EncodeQuery:
    """`remote_encode`'s parameters: `shape` (one per dimension) and `dtype` for a tensor body, none
    for an image file; `scaling_factor` / `shift_factor` are refused (see the module docstring:
    Wan normalises per channel), `do_scaling`, `precision` and `allow_non_finite` are vaed's own."""
    query = _single_values(params, ENCODE_PARAMETERS)
    shape_values = params.getall("shape", [])
    for name in ("scaling_factor", "shift_factor"):
        if name in query:
            raise InvalidInput(
                f"{name} is not used by Wan: its latents are normalised per channel (latents_mean / latents_std). "
                "Send no factor for the VAE-space latents (the posterior's mode, what remote_decode takes with "
                "do_scaling=False), or do_scaling=true for the normalised ones WanPipeline computes")
    normalised = _flag(query, "do_scaling", False)
    allow_non_finite = _flag(query, "allow_non_finite", False)
    try:
        precision = Precision.parse(query["precision"], "precision") if "precision" in query else None
    except ValueError as exc:
        raise InvalidInput(str(exc)) from None
    if not shape_values:
        if "dtype" in query:
            raise InvalidInput("dtype without shape: send shape= per dimension with a tensor body, "
                               "or neither with an image file")
        return EncodeQuery(shape=None, dtype=None, normalised=normalised, precision=precision,
                           allow_non_finite=allow_non_finite)
    shape = _shape_sizes(shape_values)
    if len(shape) not in (IMAGE_DIMS, VIDEO_DIMS) or any(d < 1 for d in shape):
        raise InvalidInput(
            f"shape must be 4 or 5 positive sizes (an image [B, 3, H, W] or video [B, 3, T, H, W] in [-1, 1]; "
            f"uint8 [B, H, W, 3] / [B, T, H, W, 3]), got {list(shape)}")
    dtype_name = query.get("dtype")
    if dtype_name is None:
        raise InvalidInput(f"dtype is required with shape: one of {', '.join(DTYPE_NAMES)}")
    if dtype_name not in DTYPE_NAMES:
        raise InvalidInput(f"dtype {dtype_name!r} is not a frame dtype; use one of {', '.join(DTYPE_NAMES)}")
    return EncodeQuery(shape=shape, dtype=DTYPE_NAMES[dtype_name], normalised=normalised, precision=precision,
                       allow_non_finite=allow_non_finite)


class DecodedImage:
    """An image file body as the call core's frames: uint8 `[1, 1, H, W, 3]` RGB (an image is a
    1-frame video; the server maps 0..255 to [-1, 1] as diffusers' image processor does). The
    size is read from the file's header and checked against `max_pixels` before the pixels are
    decoded (a small file may hold a huge image)."""

    def __init__(self, body: memoryview, max_pixels: int) -> None:
        from PIL import Image, UnidentifiedImageError

        try:
            image = Image.open(io.BytesIO(body))
            w, h = image.size
            if max_pixels and w * h > max_pixels:
                raise InvalidInput(f"image {h}x{w} ({h * w} pixels) is over the server limit of {max_pixels} pixels")
            pixels = image.convert("RGB")
        except InvalidInput:
            raise
        except Image.DecompressionBombError:
            raise InvalidInput(_too_large(max_pixels)) from None
        except UnidentifiedImageError:  # its text is the repr of the buffer PIL read
            raise InvalidInput("the body is not an image file this server reads (PNG, JPEG, ...)") from None
        except Exception as exc:  # a malformed file: PIL's format plugins raise OSError, SyntaxError,
            # ValueError, struct.error, ... (a broken PNG chunk, a truncated header, a bad PPM maxval)
            raise InvalidInput(f"the body is not an image file this server reads (PNG, JPEG, ...): "
                               f"{type(exc).__name__}: {exc}") from None
        self._frames = torch.from_numpy(np.asarray(pixels).copy())[None, None]

    def header(self) -> tuple[tuple[int, ...], torch.dtype]:
        return tuple(self._frames.shape), self._frames.dtype

    def to_tensor(self) -> torch.Tensor:
        return self._frames


def _too_large(max_pixels: int) -> str:
    """Why an image PIL refused to open as a decompression bomb (over twice Image.MAX_IMAGE_PIXELS,
    179M pixels by default: it says no size) is refused."""
    from PIL import Image

    bound = 2 * (Image.MAX_IMAGE_PIXELS or 0)
    limit = min(max_pixels, bound) if max_pixels else bound
    return f"the image is too large: over {bound} pixels, and this server takes at most {limit} pixels"


# -- answers -------------------------------------------------------------------------------


def tensor_headers(tensor: torch.Tensor) -> dict[str, str]:
    """The headers diffusers' client reads a tensor answer with."""
    return headers_for(tensor.shape, tensor.dtype)


def headers_for(shape: Sequence[int], dtype: torch.dtype) -> dict[str, str]:
    """`tensor_headers` of a tensor yet to be sent: a streamed answer knows its shape from the
    latents' before its first byte."""
    return {"shape": json.dumps(list(shape)), "dtype": _NAME_OF[dtype], "Content-Type": "tensor/binary"}


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """C-order bytes of a CPU tensor, as `torch.frombuffer(...).reshape(shape)` reads them back:
    a view of its memory, not a copy (a 720p video's RGB8 frames are 224 MB)."""
    # through uint8: numpy has no bfloat16
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data  # ndarray.data: a memoryview of it


def unit_video(raw: torch.Tensor) -> torch.Tensor:
    """The decoder's output [1, 3, T, H, W] -> [T, 3, H, W] in [0, 1], by diffusers' own
    VideoProcessor (so the client's rounding gives the local pipeline's PIL frames)."""
    from diffusers.video_processor import VideoProcessor

    return VideoProcessor().postprocess_video(raw, output_type="pt")[0]


def image_bytes(frames: torch.Tensor, image_format: str) -> bytes:
    """uint8 frames [1, H, W, 3] -> one encoded image."""
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(frames[0].numpy()).save(buffer, format=image_format)
    return buffer.getvalue()
