from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DataType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATA_TYPE_UNSPECIFIED: _ClassVar[DataType]
    UINT8: _ClassVar[DataType]
    FLOAT16: _ClassVar[DataType]
    BFLOAT16: _ClassVar[DataType]
    FLOAT32: _ClassVar[DataType]

class OutputFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_FORMAT_UNSPECIFIED: _ClassVar[OutputFormat]
    RGB8: _ClassVar[OutputFormat]
    RAW: _ClassVar[OutputFormat]
    MP4: _ClassVar[OutputFormat]
    MP4_LOSSLESS: _ClassVar[OutputFormat]

class Precision(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRECISION_UNSPECIFIED: _ClassVar[Precision]
    LOSSLESS: _ClassVar[Precision]
    FAST: _ClassVar[Precision]
DATA_TYPE_UNSPECIFIED: DataType
UINT8: DataType
FLOAT16: DataType
BFLOAT16: DataType
FLOAT32: DataType
OUTPUT_FORMAT_UNSPECIFIED: OutputFormat
RGB8: OutputFormat
RAW: OutputFormat
MP4: OutputFormat
MP4_LOSSLESS: OutputFormat
PRECISION_UNSPECIFIED: Precision
LOSSLESS: Precision
FAST: Precision

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DataType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DataType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class DecodeOptions(_message.Message):
    __slots__ = ("format", "raw_dtype", "raw_latents", "request_id", "precision", "allow_non_finite", "skip_frames", "fps", "crf", "preset")
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    RAW_DTYPE_FIELD_NUMBER: _ClassVar[int]
    RAW_LATENTS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    SKIP_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    CRF_FIELD_NUMBER: _ClassVar[int]
    PRESET_FIELD_NUMBER: _ClassVar[int]
    format: OutputFormat
    raw_dtype: DataType
    raw_latents: bool
    request_id: str
    precision: Precision
    allow_non_finite: bool
    skip_frames: int
    fps: int
    crf: int
    preset: str
    def __init__(self, format: _Optional[_Union[OutputFormat, str]] = ..., raw_dtype: _Optional[_Union[DataType, str]] = ..., raw_latents: bool = ..., request_id: _Optional[str] = ..., precision: _Optional[_Union[Precision, str]] = ..., allow_non_finite: bool = ..., skip_frames: _Optional[int] = ..., fps: _Optional[int] = ..., crf: _Optional[int] = ..., preset: _Optional[str] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("latents", "options")
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    latents: Tensor
    options: DecodeOptions
    def __init__(self, latents: _Optional[_Union[Tensor, _Mapping]] = ..., options: _Optional[_Union[DecodeOptions, _Mapping]] = ...) -> None: ...

class LatentChunk(_message.Message):
    __slots__ = ("latents", "options")
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    latents: Tensor
    options: DecodeOptions
    def __init__(self, latents: _Optional[_Union[Tensor, _Mapping]] = ..., options: _Optional[_Union[DecodeOptions, _Mapping]] = ...) -> None: ...

class FrameChunk(_message.Message):
    __slots__ = ("request_id", "chunk_index", "first_frame", "frames", "final", "video")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_INDEX_FIELD_NUMBER: _ClassVar[int]
    FIRST_FRAME_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    chunk_index: int
    first_frame: int
    frames: Tensor
    final: bool
    video: bytes
    def __init__(self, request_id: _Optional[str] = ..., chunk_index: _Optional[int] = ..., first_frame: _Optional[int] = ..., frames: _Optional[_Union[Tensor, _Mapping]] = ..., final: bool = ..., video: _Optional[bytes] = ...) -> None: ...

class EncodeOptions(_message.Message):
    __slots__ = ("request_id", "precision", "out_dtype", "latents", "allow_non_finite", "trailing_zero_frames", "encode_dtype")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    OUT_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_NON_FINITE_FIELD_NUMBER: _ClassVar[int]
    TRAILING_ZERO_FRAMES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    precision: Precision
    out_dtype: DataType
    latents: bool
    allow_non_finite: bool
    trailing_zero_frames: int
    encode_dtype: DataType
    def __init__(self, request_id: _Optional[str] = ..., precision: _Optional[_Union[Precision, str]] = ..., out_dtype: _Optional[_Union[DataType, str]] = ..., latents: bool = ..., allow_non_finite: bool = ..., trailing_zero_frames: _Optional[int] = ..., encode_dtype: _Optional[_Union[DataType, str]] = ...) -> None: ...

class VideoChunk(_message.Message):
    __slots__ = ("frames", "options")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    frames: Tensor
    options: EncodeOptions
    def __init__(self, frames: _Optional[_Union[Tensor, _Mapping]] = ..., options: _Optional[_Union[EncodeOptions, _Mapping]] = ...) -> None: ...

class LatentFrameChunk(_message.Message):
    __slots__ = ("request_id", "latent_frame", "moments", "latents", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LATENT_FRAME_FIELD_NUMBER: _ClassVar[int]
    MOMENTS_FIELD_NUMBER: _ClassVar[int]
    LATENTS_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    latent_frame: int
    moments: Tensor
    latents: Tensor
    final: bool
    def __init__(self, request_id: _Optional[str] = ..., latent_frame: _Optional[int] = ..., moments: _Optional[_Union[Tensor, _Mapping]] = ..., latents: _Optional[_Union[Tensor, _Mapping]] = ..., final: bool = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "z_dim", "scale_factor_temporal", "scale_factor_spatial", "latents_mean", "latents_std", "compute_dtype", "device", "random_weights", "max_message_bytes", "max_latent_frames", "max_pixels", "kernels", "layout", "fast_paths_note", "precisions", "devices", "parallel", "encodes", "encode_precisions", "encode_dtypes", "video_formats", "video_fps", "decoder_identity", "encoder_identity", "max_batch")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    Z_DIM_FIELD_NUMBER: _ClassVar[int]
    SCALE_FACTOR_TEMPORAL_FIELD_NUMBER: _ClassVar[int]
    SCALE_FACTOR_SPATIAL_FIELD_NUMBER: _ClassVar[int]
    LATENTS_MEAN_FIELD_NUMBER: _ClassVar[int]
    LATENTS_STD_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANDOM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_LATENT_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    FAST_PATHS_NOTE_FIELD_NUMBER: _ClassVar[int]
    PRECISIONS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_FIELD_NUMBER: _ClassVar[int]
    ENCODES_FIELD_NUMBER: _ClassVar[int]
    ENCODE_PRECISIONS_FIELD_NUMBER: _ClassVar[int]
    ENCODE_DTYPES_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FORMATS_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FPS_FIELD_NUMBER: _ClassVar[int]
    DECODER_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    ENCODER_IDENTITY_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_FIELD_NUMBER: _ClassVar[int]
    model: str
    z_dim: int
    scale_factor_temporal: int
    scale_factor_spatial: int
    latents_mean: _containers.RepeatedScalarFieldContainer[float]
    latents_std: _containers.RepeatedScalarFieldContainer[float]
    compute_dtype: DataType
    device: str
    random_weights: bool
    max_message_bytes: int
    max_latent_frames: int
    max_pixels: int
    kernels: str
    layout: str
    fast_paths_note: str
    precisions: _containers.RepeatedScalarFieldContainer[Precision]
    devices: _containers.RepeatedScalarFieldContainer[str]
    parallel: str
    encodes: bool
    encode_precisions: _containers.RepeatedScalarFieldContainer[Precision]
    encode_dtypes: _containers.RepeatedScalarFieldContainer[DataType]
    video_formats: _containers.RepeatedScalarFieldContainer[OutputFormat]
    video_fps: int
    decoder_identity: str
    encoder_identity: str
    max_batch: int
    def __init__(self, model: _Optional[str] = ..., z_dim: _Optional[int] = ..., scale_factor_temporal: _Optional[int] = ..., scale_factor_spatial: _Optional[int] = ..., latents_mean: _Optional[_Iterable[float]] = ..., latents_std: _Optional[_Iterable[float]] = ..., compute_dtype: _Optional[_Union[DataType, str]] = ..., device: _Optional[str] = ..., random_weights: bool = ..., max_message_bytes: _Optional[int] = ..., max_latent_frames: _Optional[int] = ..., max_pixels: _Optional[int] = ..., kernels: _Optional[str] = ..., layout: _Optional[str] = ..., fast_paths_note: _Optional[str] = ..., precisions: _Optional[_Iterable[_Union[Precision, str]]] = ..., devices: _Optional[_Iterable[str]] = ..., parallel: _Optional[str] = ..., encodes: bool = ..., encode_precisions: _Optional[_Iterable[_Union[Precision, str]]] = ..., encode_dtypes: _Optional[_Iterable[_Union[DataType, str]]] = ..., video_formats: _Optional[_Iterable[_Union[OutputFormat, str]]] = ..., video_fps: _Optional[int] = ..., decoder_identity: _Optional[str] = ..., encoder_identity: _Optional[str] = ..., max_batch: _Optional[int] = ...) -> None: ...
