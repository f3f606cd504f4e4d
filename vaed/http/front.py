"""The HTTP front: Hugging Face's remote-VAE protocol (`vaed.http.hf_protocol`: POST / and /decode
for `remote_decode`, POST /encode for `remote_encode`) and GET /health, as routes of the server's
aiohttp app, translated onto the call core (`vaed.calls`: its Decode and Encode).

The front is a translator, as the gRPC servicer is: the core admits the call, opens its session,
feeds the input, streams the output and logs and counts it once; the front only turns a request
into the core's input (`CallInput`: a `receive` that reads the body, a `parse` into
`InputMessage`), the core's output into an HTTP answer, and the core's statuses into HTTP codes.

Order of work for a POST, and what each refusal costs (nothing of the body is read before the
call is authorised and admitted, so a refused request spends no memory on its body):

    bearer token (when the server has one)          -> 401, body unread
    no Content-Encoding but identity                 -> 415, body unread
    Content-Length present, <= the message limit     -> 411 / 413, body unread
    query parsed (an unknown or repeated parameter refused);
            Content-Length = prod(shape) * dtype size -> 400, body unread
    the core's own checks of a first message, run on the query (`_check_decode_head`: the
            request id, the options, the shape against the model and the limits) and a JPEG's
            size                                     -> 400, body unread
    a whole (raw pt) answer over MAX_WHOLE_ANSWER_BYTES      -> 413, body unread
    the core: serving? -> 503; a session slot? -> 429   (body unread)
            -> the body read (within --session-first-message-timeout, else 504)
            -> every latent frame checked for NaN / Inf (400) -> decoded (the core checks the
               message again: gRPC's calls have no head)
    the answer: pt + partial_postprocess and pil + a processor stream each group's frames as
            they decode (`hf_protocol` says why raw pt cannot, and is sent once the call is
            done); mp4 is sent whole (over MAX_WHOLE_ANSWER_BYTES: 413), or with stream=true as
            chunked fMP4 as it is encoded

Why the NaN / Inf check is the front's too: the core checks each latent frame as it decodes it,
and a streamed answer's status went out with its first frames, so a NaN in a later frame could
only cut the body; the whole body is in memory before any answer, so the front checks it all
first (`hf_protocol.check_finite_latents`, the core's check and message), off the event loop.

Every answer to a POST whose `X-Request-Id` is valid carries it back, errors included; a call
sent without one is answered, on success, with the id the core gave it.

Why `receive` reads the body: the core calls it only after admission, so the order above is the
core's own, not a second copy of it. The body is read into one buffer of exactly Content-Length
bytes (uninitialised, so it becomes resident only as the bytes arrive), which the latents tensor
then views (no copy); aiohttp's reader holds at most its 64 KiB high-water mark of unread body
meanwhile (it pauses the socket past that).

Bounded memory on the way out: every answer is written in pieces of at most SEND_SLICE_BYTES,
each write waiting until the transport's buffer is under its high-water mark, so a slow reader
holds its own answer (a streamed one: the credit window's few groups; the core stops decoding
it meanwhile) and never a second copy of it in the transport; a reader that takes nothing for
--send-timeout seconds has its connection closed (`vaed.http.server`), which ends the call.

Authentication: the same token as the gRPC port (`--auth-token-file` / $VAED_AUTH_TOKEN), sent as
`Authorization: Bearer <token>`. diffusers' `remote_decode` sends no token: against a server with
one it gets 401. Serve it tokenless only where the network is the boundary (bind the HTTP port to
loopback, or admit only the pipeline's pods with a NetworkPolicy); docs/deployment.md says how.
GET /health needs no token, as gRPC health does.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import torch
from aiohttp import HttpVersion11, hdrs, web

from vaed_client.wire import output_frames

from ..calls import (
    CallCore,
    CallEnd,
    CallFailed,
    CallInput,
    FramesOut,
    InputMessage,
    LatentFrameOut,
    LatentsIn,
    RequestedEncode,
    RequestedOutput,
    VideoMessage,
    VideoOut,
    checked_request_id,
)
from ..errors import InvalidInput, NotReady, Status
from .hf_protocol import (
    Answer,
    DeclaredTensor,
    DecodedImage,
    DecodeQuery,
    EncodeQuery,
    RawLatents,
    check_body_bytes,
    check_decoded_size,
    check_encoder_frames,
    check_finite_latents,
    headers_for,
    image_bytes,
    parse_encode_query,
    parse_query,
    tensor_bytes,
    tensor_headers,
    unit_video,
)
from .server import json_error, send_timed_out

log = logging.getLogger(__name__)

DECODE_PATHS = ("/", "/decode")
ENCODE_PATH = "/encode"
HEALTH_PATH = "/health"
REQUEST_ID_HEADER = "X-Request-Id"
# The methods the core logs and counts HTTP calls under (vaed_requests_total{method="Decode"}), as gRPC's.
METHOD = "Decode"
ENCODE_METHOD = "Encode"

# An answer is handed to the transport this much at a time (each write waits for the client
# to have taken the one before): aiohttp would otherwise copy a whole 224 MB answer into the
# transport's buffer for a client that reads slowly.
SEND_SLICE_BYTES = 1 << 20

# pt without partial_postprocess answers [B, 3, T, H, W] whole, in the compute dtype: time is not
# its outer axis, so the frames fill one buffer before the first byte goes out. The buffer grows
# with the video, not with the body: one allowed 256 MiB body of float16 latents
# [8, 16, 1024, 32, 32] asks for a 12.9 GB answer in bf16 (25.7 GB in float32). 4 GiB holds a
# 704x1280x121 Wan2.2 video in float32 (1.3 GB) three times; longer videos stream as uint8
# (partial_postprocess) or mp4, or go in parts. A whole mp4 is held to the same bound, counted as
# its bytes come (its size is not known before): lossless 720p noise is ~2.5 MB a frame.
MAX_WHOLE_ANSWER_BYTES = 4 << 30

# On 429 / 503 (a Status's value is its HTTP code): a session slot or a replica is usually free
# within a decode.
RETRY_AFTER_SECONDS = "1"

_HOW_TO_AUTH = "send 'Authorization: Bearer <token>' (the server's --auth-token-file / $VAED_AUTH_TOKEN)"


def _status_answer(status: Status, message: str) -> web.Response:
    code = int(status)
    extra = {hdrs.RETRY_AFTER: RETRY_AFTER_SECONDS} if code in (429, 503) else {}
    return json_error(code, message, extra)


def request_id_of(request: web.BaseRequest) -> str:
    """The request's X-Request-Id ("" without one); InvalidInput when it comes more than once,
    which would leave the caller and the server's log disagreeing on which one names the call."""
    ids = request.headers.getall(REQUEST_ID_HEADER, [])
    if len(ids) > 1:
        raise InvalidInput(f"{REQUEST_ID_HEADER} came {len(ids)} times; send it once")
    return ids[0] if ids else ""


def _logged_request_id(request: web.BaseRequest) -> str:
    """The request's X-Request-Id for a log line: "-" when it has none or one that is not valid
    (its text stays out of the log)."""
    try:
        sent = request_id_of(request)
        return checked_request_id(sent) if sent else "-"
    except InvalidInput:
        return "-"


async def _echo_request_id(request: web.BaseRequest, response: web.StreamResponse) -> None:
    """Every answer of the app carries the request's X-Request-Id when it is valid (aiohttp's own
    404, 405 and 417 too; a streamed answer names it already): run as the answer's headers are
    made (`on_response_prepare`)."""
    if REQUEST_ID_HEADER in response.headers:
        return
    try:
        request_id = request_id_of(request)
        if request_id:
            response.headers[REQUEST_ID_HEADER] = checked_request_id(request_id)
    except InvalidInput:
        pass  # not echoed: the answer is the 400 that refuses it


def encoded_body(request: web.Request) -> str | None:
    """Why a body in a content coding is refused, or None: the body is read into a buffer of
    exactly Content-Length bytes, the size of what it declares (a gzip body whose inflation failed
    was a 500 from aiohttp's decoder, a valid one a length mismatch)."""
    coding = request.headers.get(hdrs.CONTENT_ENCODING, "identity").strip().lower()
    if coding in ("", "identity"):
        return None
    return f"Content-Encoding {coding!r} is not supported: send the body uncompressed"


def _expects_continue(request: web.BaseRequest) -> bool:
    return request.version == HttpVersion11 and request.headers.get(hdrs.EXPECT, "").lower() == "100-continue"


async def defer_continue(request: web.Request) -> None:
    """`Expect: 100-continue` (curl sends it for bodies over 1 MiB): aiohttp's default handler
    answers 100 Continue before the route's handler runs, so a client would send its body to a
    request about to be refused. The front sends it only when it reads the body: after the token,
    the head checks and admission (a refused client then never sends it)."""
    if request.version == HttpVersion11 and not _expects_continue(request):
        raise web.HTTPExpectationFailed(text=f"unknown Expect: {request.headers.get(hdrs.EXPECT)}")


class HfFront:
    """The HTTP front's routes over one CallCore (see the module docstring)."""

    def __init__(
        self, core: CallCore, token: str | None = None, on_refused: Callable[[str, str], None] | None = None,
    ) -> None:
        self.core = core
        self._token = token.encode("utf-8") if token is not None else None
        self._on_refused = on_refused or (lambda method, code: None)
        self.bodies_read = 0  # request bodies the front started reading (tests: refusals read none)

    def add_routes(self, app: web.Application) -> None:
        for path in DECODE_PATHS:
            app.router.add_post(path, self.decode, expect_handler=defer_continue)
        app.router.add_post(ENCODE_PATH, self.encode, expect_handler=defer_continue)
        app.router.add_get(HEALTH_PATH, self.health, allow_head=False)
        app.on_response_prepare.append(_echo_request_id)

    # -- GET /health -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """200 only while the server is SERVING (what a load balancer or probe needs)."""
        try:
            self.core.check_serving()
        except NotReady as exc:
            return web.json_response({"status": "NOT_SERVING", "error": str(exc)}, status=503)
        return web.json_response({"status": "SERVING"})

    # -- POST / and /decode ------------------------------------------------------------------

    def _refuse(self, request: web.Request, code: str, status: int, message: str, method: str = METHOD,
                **headers: str) -> web.Response:
        """A request refused before the core saw it, counted as a refused call (`code`: a gRPC
        status name, as the metrics take it) and logged as the core logs a failed call, under the
        request's X-Request-Id ("-" without a valid one)."""
        self._on_refused(method, code)
        log.warning("%s id=%s status=%s refused from its head (HTTP %d) error=%s",
                    method, _logged_request_id(request), code, status, json.dumps(message))
        return json_error(status, message, headers)

    def _refused_head(self, request: web.Request, method: str) -> web.Response | None:
        """The checks of a POST's head that need no query: the token, the content coding, then
        Content-Length."""
        if (problem := self.unauthorised(request)) is not None:
            return self._refuse(request, "UNAUTHENTICATED", 401, problem, method, **{hdrs.WWW_AUTHENTICATE: "Bearer"})
        if (problem := encoded_body(request)) is not None:
            return self._refuse(request, Status.INVALID_ARGUMENT.name, 415, problem, method)
        length = request.content_length
        what = "latents'" if method == METHOD else "frames'"
        if length is None:
            return self._refuse(request, Status.INVALID_ARGUMENT.name, 411,
                                f"Content-Length is required: send the {what} bytes as one body of known size", method)
        limit = self.core.config.max_message_bytes
        if length > limit:
            # Not "in parts": the VAE is causal, so parts decoded or encoded apart are not the video's
            # (an encoded second part's latents differed from the whole's by up to 0.42).
            smaller = ("as bfloat16 or float16 latents, or decode it with gRPC's DecodeStream, which takes a "
                       "video in chunks" if method == METHOD else
                       "as uint8 frames (a quarter of float32's bytes) or bfloat16, or encode it with gRPC's "
                       "Encode, which takes a video in chunks")
            return self._refuse(request, Status.INVALID_ARGUMENT.name, 413,
                                f"the body is {length} bytes and this server takes at most {limit} "
                                f"bytes (its message limit); send it {smaller}", method)
        return None

    def unauthorised(self, request: web.Request) -> str | None:
        """None when the request may go on, else why not."""
        if self._token is None:
            return None
        values = request.headers.getall(hdrs.AUTHORIZATION, [])
        if not values:
            return f"missing credentials: this server requires a bearer token; {_HOW_TO_AUTH}"
        scheme, _, token = values[0].strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return f"malformed Authorization header: expected 'Bearer <token>'; {_HOW_TO_AUTH}"
        # compare_digest on bytes: constant time in the token's content, any input accepted
        if not hmac.compare_digest(token.strip().encode("utf-8", "replace"), self._token):
            return "invalid bearer token"
        return None

    async def decode(self, request: web.Request) -> web.StreamResponse:
        return await self._guarded(request, self._decode)

    async def _guarded(self, request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
        try:
            return await handler(request)
        except Exception:
            # the core reports its own failures as CallFailed; this is the front's own bug
            log.exception("HTTP front: internal error on %s %s", request.method, request.path)
            return json_error(500, "internal error in the HTTP front; see the server log")

    async def _decode(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._refused_head(request, METHOD)) is not None:
            return refused
        length = request.content_length
        assert length is not None  # _refused_head checked it
        try:
            query = parse_query(request.query, request.headers.get(hdrs.ACCEPT, ""), self.core.default_fps())
            check_body_bytes(length, "latents", query.shape, query.dtype)
            request_id = request_id_of(request)
            self._check_decode_head(request_id, query)
        except InvalidInput as exc:
            return self._refuse(request, Status.INVALID_ARGUMENT.name, 400, str(exc))
        if (answer_bytes := self._whole_answer_bytes(query)) > MAX_WHOLE_ANSWER_BYTES:
            # the streamed answers take one video a call
            other = ("decode one video per call (partial_postprocess=true and output_type mp4, which "
                     "stream, take batch 1)" if query.shape[0] > 1 else
                     "ask partial_postprocess=true (uint8 frames, streamed) or output_type mp4")
            return self._refuse(request, Status.INVALID_ARGUMENT.name, 413,
                                f"the answer would be {answer_bytes} bytes, and output_type pt without "
                                f"partial_postprocess is sent whole: this server holds at most "
                                f"{MAX_WHOLE_ANSWER_BYTES} bytes for one; decode fewer frames per call, or {other}")
        call = self.core.decode(self._input(request, query, length, request_id), self._to_message(query),
                                lambda: send_timed_out(request))
        try:
            return await self._answer(request, query, call)
        except CallFailed as exc:
            return _status_answer(exc.status, exc.message)
        finally:
            await call.aclose()

    def _check_decode_head(self, request_id: str, query: DecodeQuery) -> None:
        """The core's own checks of a Decode's first message (`CallCore._open`: the request id, the
        options, and the latents' header against the model and the limits), run on the query, which
        holds all they read: a request they refuse is refused before admission and before its body
        is read (a full server would otherwise answer it 429, or read its body to answer 400)."""
        engine = self.core.pool.engine
        if engine is None:
            return  # no device serves: the core answers 503 when the call asks for a slot
        check_decoded_size(query, engine.scale_spatial)
        head = DeclaredTensor(query.shape, query.dtype)
        self.core.check_decode_head(InputMessage(request_id, head, lambda: _requested(query)))

    # -- POST /encode ------------------------------------------------------------------------

    async def encode(self, request: web.Request) -> web.StreamResponse:
        return await self._guarded(request, self._encode)

    async def _encode(self, request: web.Request) -> web.StreamResponse:
        """diffusers' `remote_encode`: the head checked as a decode's, the call run by the core's
        Encode (admission, limits, the session, the log line), the latent frames joined into the
        answer `hf_protocol` describes."""
        if (refused := self._refused_head(request, ENCODE_METHOD)) is not None:
            return refused
        length = request.content_length
        assert length is not None  # _refused_head checked it
        try:
            query = parse_encode_query(request.query)
            if query.shape is not None and query.dtype is not None:
                check_body_bytes(length, "frames", query.shape, query.dtype)
            sent_id = request_id_of(request)
            self._check_encode_head(sent_id, query)
        except InvalidInput as exc:
            return self._refuse(request, Status.INVALID_ARGUMENT.name, 400, str(exc), ENCODE_METHOD)
        call = self.core.encode(self._encode_input(request, query, length, sent_id), lambda item: item,
                                lambda: False)
        pieces: list[torch.Tensor] = []
        request_id = ""
        try:
            async for item in call:
                if isinstance(item, LatentFrameOut):
                    piece = item.latents if query.normalised else item.moments
                    assert piece is not None  # the core adds the normalised latents where the call asked for them
                    pieces.append(piece)
                else:
                    request_id = item.request_id
        except CallFailed as exc:
            return _status_answer(exc.status, exc.message)
        finally:
            await call.aclose()
        latents = torch.cat(pieces, dim=2)
        if not query.normalised:  # the moments' first half: the mean, the posterior's mode
            latents = latents[:, : latents.shape[1] // 2]
        if query.image:
            latents = latents[:, :, 0]
        return web.Response(body=tensor_bytes(latents),
                            headers={REQUEST_ID_HEADER: request_id, **tensor_headers(latents)})

    def _check_encode_head(self, request_id: str, query: EncodeQuery) -> None:
        """As `_check_decode_head`, for an Encode (`CallCore._open_encode`, then the frames' header
        against the limits and the encoder's frame count); an image file's size is checked once
        its header arrives, with its body."""
        engine = self.core.pool.engine
        if engine is None or not engine.encodes:
            return  # the core refuses the call: 503, or "does not encode"
        head = DeclaredTensor(query.video_shape if query.shape is not None else None, query.dtype)
        try:
            self.core.check_encode_head(VideoMessage(request_id, head, lambda: _requested_encode(query)),
                                        shape_known=query.shape is not None)
        except InvalidInput as exc:
            raise query.as_sent(exc) if query.shape is not None else exc from None
        if query.shape is not None:
            check_encoder_frames(query, engine.scale_temporal)

    def _encode_input(self, request: web.Request, query: EncodeQuery, length: int,
                      request_id: str) -> CallInput[memoryview]:
        """The core's view of an encode request: one message (the body: a tensor, or an image
        file decoded once it is read), then the end. `request_id`: the header's, as the head
        checked it."""
        receive = self._body_once(request, length)

        def parse(body: memoryview) -> VideoMessage:
            frames: LatentsIn
            if query.shape is None:
                frames = DecodedImage(body, self.core.config.max_pixels)
            else:
                assert query.dtype is not None  # a tensor body's dtype comes with its shape (EncodeQuery)
                frames = RawLatents(body, query.video_shape, query.dtype)
            return VideoMessage(request_id=request_id, frames=frames,
                                options=lambda: _requested_encode(query))

        return CallInput(receive=receive, parse=parse, request_id=request_id)

    def _input(self, request: web.Request, query: DecodeQuery, length: int,
               request_id: str) -> CallInput[memoryview]:
        """The core's view of the request: one message (the body, its latents checked for NaN / Inf
        unless the call allows them), then the end. `request_id`: the header's, as the head checked it."""
        def check(body: memoryview) -> None:
            check_finite_latents(RawLatents(body, query.shape, query.dtype).to_tensor())

        receive = self._body_once(request, length, None if query.allow_non_finite else check)

        def parse(body: memoryview) -> InputMessage:
            return InputMessage(request_id=request_id,
                                latents=RawLatents(body, query.shape, query.dtype), options=lambda: _requested(query))

        return CallInput(receive=receive, parse=parse, request_id=request_id)

    def _body_once(self, request: web.Request, length: int, check: Callable[[memoryview], None] | None = None,
                   ) -> Callable[[], Awaitable[memoryview | None]]:
        """The call core's `receive` for a one-message request: the body (`check`ed on a thread, not
        the event loop: a pass over as much as the message limit, 256 MiB by default), then the end."""
        read = False

        async def receive() -> memoryview | None:
            nonlocal read
            if read:
                return None
            read = True
            body = await self.read_body(request, length)
            if check is not None:
                await asyncio.to_thread(check, body)
            return body

        return receive

    async def read_body(self, request: web.Request, length: int) -> memoryview:
        """Exactly `length` bytes into one buffer, as they arrive. Uninitialised memory
        (torch.empty: large blocks are fresh pages from the OS), so the buffer becomes resident as
        the body arrives: a client that claims 256 MiB and sends nothing costs nothing (a zeroed
        bytearray would cost its Content-Length at once, for --session-first-message-timeout)."""
        self.bodies_read += 1
        if _expects_continue(request):  # the client holds its body back until told to send it
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # as aiohttp's own expect handler: the answer has not begun
        view = torch.empty(length, dtype=torch.uint8).numpy().data  # a writable memoryview of it
        got = 0
        try:
            while got < length:
                chunk = await request.content.readany()
                if not chunk:
                    break
                view[got:got + len(chunk)] = chunk
                got += len(chunk)
        except (ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            raise InvalidInput(f"the body ended after {got} of {length} bytes ({exc})") from None
        if got != length:
            raise InvalidInput(f"the body ended after {got} of {length} bytes")
        return view

    @staticmethod
    def _to_message(query: DecodeQuery) -> Callable[[FramesOut | VideoOut | CallEnd], Any]:
        # On CUDA a group's frames are in pinned host memory, which torch's host allocator keeps
        # cached once allocated: the frames go into pageable memory (a streamed answer's copy, or
        # the whole answer's buffer) before the next group is asked for, so pinned memory stays at
        # the credit window's few groups per session. mp4's pieces the core encodes before asking.
        if query.answer in (Answer.MP4, Answer.RAW, Answer.IMAGE):
            return lambda item: item
        return lambda item: item if not isinstance(item, FramesOut) else FramesOut(
            item.request_id, item.chunk_index, item.first_frame, item.frames.clone())

    def _whole_answer_bytes(self, query: DecodeQuery) -> int:
        """The bytes of a raw pt answer (0 for the other answers, and before a device serves: the
        core refuses the call then)."""
        engine = self.core.pool.engine
        if query.answer is not Answer.RAW or engine is None:
            return 0
        b, _, _, h, w = query.shape
        pixels = h * w * engine.scale_spatial**2
        return b * 3 * self._output_frames(query) * pixels * engine.info.dtype.itemsize

    def _output_frames(self, query: DecodeQuery) -> int:
        engine = self.core.pool.engine
        assert engine is not None  # the call was admitted and opened: a worker serves it
        return output_frames(query.shape[2], engine.scale_temporal)

    async def _answer(self, request: web.Request, query: DecodeQuery, call: Any) -> web.StreamResponse:
        try:
            if query.answer is Answer.MP4:
                return await self._mp4(request, query, call)
            if query.answer in (Answer.FRAMES, Answer.UNIT):
                return await self._stream_frames(request, query, call)
            return await self._whole(request, query, call)
        except ConnectionError:
            # the client went away mid-answer; closing the call (the caller's finally) logs it CANCELLED
            return web.Response(status=499)

    async def _whole(self, request: web.Request, query: DecodeQuery, call: Any) -> web.StreamResponse:
        """pt (raw) and a pil image: each piece copied, as it arrives, into one buffer of the
        answer's size (allocated at the first piece: the latents' shape gives the frame count),
        then sent."""
        time_dim = 1 if query.rgb8 else 2
        video: torch.Tensor | None = None
        request_id = ""
        async for item in call:
            if isinstance(item, CallEnd):
                request_id = item.request_id
                continue
            if video is None:
                shape = list(item.frames.shape)
                shape[time_dim] = self._output_frames(query)
                video = torch.empty(shape, dtype=item.frames.dtype)
            video.narrow(time_dim, item.first_frame, item.frames.shape[time_dim]).copy_(item.frames)
        assert video is not None  # T >= 1 latent frame decodes to >= 1 frame
        headers = {REQUEST_ID_HEADER: request_id}
        if query.answer is Answer.IMAGE:
            content_type = "image/png" if query.image_format == "PNG" else "image/jpeg"
            return web.Response(body=image_bytes(video[0], query.image_format), content_type=content_type,
                                headers=headers)
        return await _send_whole(request, tensor_bytes(video), {**headers, **tensor_headers(video)})

    async def _stream_frames(self, request: web.Request, query: DecodeQuery, call: Any) -> web.StreamResponse:
        """pt + partial_postprocess ([T, H, W, 3] uint8) and pil + a processor ([T, 3, H, W]):
        each group's bytes sent as it decodes, after the headers and Content-Length that the
        latents' shape gives (see `hf_protocol`).

        The piece that completes the Content-Length goes out once the call has ended: a client
        with every byte of its answer may close at once, and a close while the call still waited
        for its end cancelled it, logging and counting a delivered answer as CANCELLED. A
        whole answer is sent after its call's end for the same reason."""
        response: web.StreamResponse | None = None
        sent = 0
        last: memoryview | None = None
        try:
            async for item in call:
                if isinstance(item, CallEnd):
                    continue
                piece = item.frames[0] if query.answer is Answer.FRAMES else unit_video(item.frames)
                if response is None:
                    shape = (self._output_frames(query), *piece.shape[1:])
                    response = web.StreamResponse(
                        headers={REQUEST_ID_HEADER: item.request_id, **headers_for(shape, piece.dtype)})
                    response.content_length = math.prod(shape) * piece.element_size()
                    await response.prepare(request)
                data = tensor_bytes(piece)
                sent += len(data)
                if sent == response.content_length:
                    last = data  # a copy the front owns (`_to_message`), kept until the call ends
                else:
                    await _write(response, data)
        except CallFailed as exc:
            if response is None:
                raise
            self._cut(exc, request)
            return response
        assert response is not None and last is not None  # T >= 1 latent frame decodes to >= 1 frame
        await _write(response, last)
        await response.write_eof()
        return response

    @staticmethod
    def _cut(exc: CallFailed, request: web.Request) -> None:
        """A failure after the status line went out with the first bytes: cut the body short,
        which every HTTP client reports as an incomplete answer."""
        log.warning("HTTP answer cut after its status was sent: %s", exc.message)
        if request.transport is not None:
            request.transport.abort()

    async def _mp4(self, request: web.Request, query: DecodeQuery, call: Any) -> web.StreamResponse:
        """The video's MP4 bytes, encoded by the core as the groups decode (`VideoOut`); with
        stream=true each part goes out at once (chunked), else each is appended to the one buffer
        sent at the end (held once; bytearray grows in place, by mremap for large ones), at most
        MAX_WHOLE_ANSWER_BYTES of it."""
        whole = bytearray()
        response: web.StreamResponse | None = None
        request_id = ""
        try:
            async for item in call:
                if isinstance(item, CallEnd):
                    request_id = item.request_id
                    continue
                data = item.data
                if not query.stream:
                    whole += data
                    if len(whole) > MAX_WHOLE_ANSWER_BYTES:
                        await call.end_refused(Status.INVALID_ARGUMENT)  # as a body over the bound is
                        return _mp4_too_large()
                elif data:
                    if response is None:
                        response = web.StreamResponse(
                            headers={hdrs.CONTENT_TYPE: "video/mp4", REQUEST_ID_HEADER: item.request_id})
                        if request.version >= HttpVersion11:
                            response.enable_chunked_encoding()
                        # else HTTP/1.0, which has no chunks (a proxy's default, nginx's among
                        # them): the body runs to the connection's close, as aiohttp then sends it
                        await response.prepare(request)
                    await _write(response, data)
        except CallFailed as exc:
            if response is None:
                raise
            self._cut(exc, request)
            return response
        if response is not None:
            await response.write_eof()
            return response
        return await _send_whole(request, memoryview(whole),
                                 {hdrs.CONTENT_TYPE: "video/mp4", REQUEST_ID_HEADER: request_id})


def _requested(query: DecodeQuery) -> RequestedOutput:
    """A decode's options, as the core takes them."""
    return RequestedOutput(rgb8=query.rgb8, raw_latents=query.raw_latents, precision=query.precision,
                           allow_non_finite=query.allow_non_finite, video=query.video)


def _requested_encode(query: EncodeQuery) -> RequestedEncode:
    """An encode's options, as the core takes them."""
    return RequestedEncode(latents=query.normalised, precision=query.precision, allow_non_finite=query.allow_non_finite)


def _mp4_too_large() -> web.Response:
    return json_error(413, f"the MP4 passed {MAX_WHOLE_ANSWER_BYTES} bytes, and output_type mp4 without stream=true "
                           f"is sent whole: this server holds at most {MAX_WHOLE_ANSWER_BYTES} bytes for one; ask "
                           "stream=true (sent as it is encoded), or decode fewer frames per call")


async def _write(response: web.StreamResponse, body: bytes | memoryview) -> None:
    """`body` in slices, each after the client has taken the previous one (see SEND_SLICE_BYTES)."""
    view = memoryview(body)
    for start in range(0, len(view), SEND_SLICE_BYTES):
        await response.write(view[start:start + SEND_SLICE_BYTES])


async def _send_whole(request: web.Request, body: memoryview, headers: dict[str, str]) -> web.StreamResponse:
    """A whole answer of known length, written in slices."""
    response = web.StreamResponse(headers=headers)
    response.content_length = len(body)
    await response.prepare(request)
    await _write(response, body)
    await response.write_eof()
    return response
