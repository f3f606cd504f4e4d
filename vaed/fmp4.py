"""One fMP4 fragment (`moof` + `mdat`) per H.264 packet, written the moment the packet exists.

Why vaed writes these boxes itself: FFmpeg's mov muxer cuts a fragment only when the *next*
packet arrives (`frag_every_frame`, `frag_duration`, `min_frag_duration` and `frag_keyframe` are
all checked then), and its one explicit cut, `movflags=frag_custom` with `av_write_frame(ctx,
NULL)`, is not reachable from PyAV (its `mux` calls only `av_interleaved_write_frame`; a
`flush()` for it was proposed to PyAV and closed unmerged). Through the muxer, a Wan video's
first frame (a group of its own) would leave only with the second group, ~one decoder call
later, and each group's last frame with the next group. FFmpeg still writes the init segment
(`ftyp` + an empty `moov` with the `avcC`, `mvex`/`trex`); only the fragments are ours.

A fragment, as ISO/IEC 14496-12 lays it out and as FFmpeg's own (`default_base_moof`) are:

    moof
      mfhd   sequence_number (1, 2, ...)
      traf
        tfhd   track_ID; flags: default-base-is-moof (offsets count from the moof)
        tfdt   version 1: baseMediaDecodeTime (64-bit, in the track's timescale)
        trun   one sample: data offset (to the mdat's payload), duration, size, flags
    mdat     the sample: the packet's NAL units, each behind a 4-byte length (MP4's form; x264
             writes Annex B start codes)

100 bytes of `moof` + 8 of `mdat` header per frame: under 0.1 % of a 480p frame's H.264 bytes.
"""

from __future__ import annotations

import struct

_BASE_IS_MOOF = 0x020000  # tfhd: offsets are relative to the moof's first byte
# trun: data-offset, sample-duration, sample-size, sample-flags present
_TRUN_FLAGS = 0x000001 | 0x000100 | 0x000200 | 0x000400
_SYNC_SAMPLE = 0x02000000      # depends on no other sample (an IDR frame)
_NON_SYNC_SAMPLE = 0x01010000  # depends on others, not a sync sample (FFmpeg's default flags)


def _box(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", 8 + len(payload)) + kind + payload


def _full_box(kind: bytes, version: int, flags: int, payload: bytes) -> bytes:
    return _box(kind, struct.pack(">I", (version << 24) | flags) + payload)


def _find(data: bytes, path: tuple[bytes, ...]) -> bytes:
    """The payload of the box at `path` (each a box type, from the top level of `data`)."""
    at, end = 0, len(data)
    for kind in path:
        while at + 8 <= end:
            size, found = struct.unpack(">I4s", data[at:at + 8])
            if size < 8:
                raise ValueError(f"malformed box {found!r} of size {size}")
            if found == kind:
                at, end = at + 8, at + size
                break
            at += size
        else:
            raise ValueError(f"no {b'/'.join(path).decode()} box in the init segment")
    return data[at:end]


def track_facts(init: bytes) -> tuple[int, int]:
    """(track_ID, timescale) of the single video track of an init segment (FFmpeg's)."""
    tkhd = _find(init, (b"moov", b"trak", b"tkhd"))
    mdhd = _find(init, (b"moov", b"trak", b"mdia", b"mdhd"))
    # tkhd / mdhd: version, then creation and modification times (32-bit in version 0, 64 in 1)
    times = 8 if tkhd[0] == 0 else 16
    track_id = struct.unpack(">I", tkhd[4 + times:8 + times])[0]
    times = 8 if mdhd[0] == 0 else 16
    timescale = struct.unpack(">I", mdhd[4 + times:8 + times])[0]
    return track_id, timescale


def length_prefixed(annex_b: bytes) -> bytes:
    """H.264 NAL units behind start codes (00 00 01 / 00 00 00 01) -> each behind its 4-byte length."""
    starts = []
    at = annex_b.find(b"\x00\x00\x01")
    while at >= 0:
        starts.append(at)
        at = annex_b.find(b"\x00\x00\x01", at + 3)
    if not starts or starts[0] > 1:  # libx264 through FFmpeg writes Annex B, always
        raise ValueError("the encoder's packet does not start with an H.264 start code")
    out = []
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else len(annex_b)
        if i + 1 < len(starts) and annex_b[end - 1] == 0:  # a 4-byte start code's leading zero
            end -= 1
        nal = annex_b[start + 3:end]
        out.append(struct.pack(">I", len(nal)) + nal)
    return b"".join(out)


def fragment(sequence: int, track_id: int, decode_time: int, duration: int, sample: bytes, keyframe: bool) -> bytes:
    """One sample's `moof` + `mdat` (see the module docstring); `sample` already length-prefixed."""
    mfhd = _full_box(b"mfhd", 0, 0, struct.pack(">I", sequence))
    tfhd = _full_box(b"tfhd", 0, _BASE_IS_MOOF, struct.pack(">I", track_id))
    tfdt = _full_box(b"tfdt", 1, 0, struct.pack(">Q", decode_time))
    flags = _SYNC_SAMPLE if keyframe else _NON_SYNC_SAMPLE
    trun_size = 8 + 4 + 4 + 4 + 12  # header, version/flags, sample_count, data_offset, one sample
    moof_size = 8 + len(mfhd) + 8 + len(tfhd) + len(tfdt) + trun_size
    trun = _full_box(b"trun", 0, _TRUN_FLAGS,
                     struct.pack(">IiIII", 1, moof_size + 8, duration, len(sample), flags))
    moof = _box(b"moof", mfhd + _box(b"traf", tfhd + tfdt + trun))
    assert len(moof) == moof_size
    return moof + _box(b"mdat", sample)
